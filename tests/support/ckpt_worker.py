"""Subprocess entry points for the checkpoint tests that need a process of their own, started
with ``support.processes.python_env()``:

    python -m support.ckpt_worker fsize ROOT LIMIT     saves under RLIMIT_FSIZE, prints JSON outcomes
    python -m support.ckpt_worker zygote ROOT          forks savers on request (kill-safety test):
        stdin "fork\n" -> forks a child that saves step after step forever; prints its pid
        stdin "reap PID\n" -> waits for that child; prints its wait status
    python -m support.ckpt_worker gloo DIR RANK WORLD PORT CASES   a torch.distributed rank

Kept apart from the tests so that a child starts from a fresh interpreter that has never run a
parallel torch kernel (forking after one is unsafe).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import signal
import sys
import threading
from pathlib import Path

import torch

import ckpt
from fsdpx import Mesh, Spec, shard, strategies

KILL_MESH, KILL_STRATEGY = Mesh(dp=2), strategies.zero3()
KILL_SHAPE = (256, 32)


def kill_state(step: int, rank: int) -> dict:
    """Rank ``rank``'s local state at ``step``: every element equals ``step``."""
    w = shard(torch.full(KILL_SHAPE, float(step)), KILL_STRATEGY.param_at_rest(2), KILL_MESH)[rank]
    return {"params": {"w": w}, "opt_state": {"mu": {"w": w * 2}}, "step": step}


def _saver_forever(root: str) -> None:
    torch.set_num_threads(1)
    done = ckpt.manager.committed_steps(Path(root))
    start = (max(done) + 1) if done else 0
    group = ckpt.ThreadGroup(KILL_MESH.size)

    def rank_loop(rank: int) -> None:
        m = ckpt.CheckpointManager(root, mesh=KILL_MESH, strategy=KILL_STRATEGY, coordinator=group.member(rank),
                                   keep_last=3)
        for step in itertools.count(start):
            m.save(step, kill_state(step, rank))

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(KILL_MESH.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def zygote(root: str) -> None:
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    _saver_forever(root)
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif cmd[0] == "reap":
            _, status = os.waitpid(int(cmd[1]), 0)
            print(status, flush=True)
        else:
            return


def fsize(root: str, limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    m = ckpt.CheckpointManager(root, keep_last=5)
    small = {"params": {"w": torch.ones(256)}, "step": 1}
    big = {"params": {"w": torch.ones(4 * limit)}, "step": 2}
    out = {}
    m.save(1, small)
    out["small"] = "ok"
    for name, step, blocking in (("big_blocking", 2, True), ("big_async", 3, False)):
        try:
            m.save(step, big, blocking=blocking)
            m.wait()
            out[name] = "saved"
        except ckpt.SaveError as e:
            out[name] = f"{type(e.__cause__).__name__}: errno {getattr(e.__cause__, 'errno', None)}"
    m.save(4, {**small, "step": 4})
    out["after"] = "ok"
    print(json.dumps(out), flush=True)


def gloo(directory: str, rank: int, world: int, port: int, cases: str) -> None:
    """Rank ``rank`` of ``world`` gloo processes: save every case of ``cases`` (JSON) on its
    save mesh; then, after a barrier, the ranks of each case's load mesh load it and compare.
    Prints one JSON report per loaded case."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coord = ckpt.TorchDistCoordinator(timeout=60)
    cases = json.loads(cases)
    fulls = [torch.randn(c["shape"], generator=torch.Generator().manual_seed(c["seed"]), dtype=torch.float64)
             for c in cases]
    for i, (case, full) in enumerate(zip(cases, fulls)):
        mesh, spec = Mesh(**dict(case["save"]["mesh"])), Spec.parse(case["save"]["spec"])
        local = shard(full, spec, mesh)[rank]
        ckpt.save(Path(directory) / f"case_{i}", {"t": local, "i": i}, mesh=mesh, strategy=None, coordinator=coord,
                  specs={"t": spec}, blocking=bool(i % 2)).wait()
    dist.barrier()
    report = []
    for i, (case, full) in enumerate(zip(cases, fulls)):
        mesh, spec = Mesh(**dict(case["load"]["mesh"])), Spec.parse(case["load"]["spec"])
        if rank >= mesh.size:
            continue
        stats = ckpt.ReadStats()
        out = ckpt.load(Path(directory) / f"case_{i}", mesh=mesh, strategy=None, rank=rank, specs={"t": spec},
                        stats=stats)
        ok = torch.equal(out["t"], shard(full, spec, mesh)[rank]) and out["i"] == i
        report.append({"case": i, "ok": ok, "read": stats.bytes_read, "needed": stats.bytes_needed})
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "zygote":
        zygote(args[0])
    elif cmd == "fsize":
        fsize(args[0], int(args[1]))
    elif cmd == "gloo":
        gloo(args[0], int(args[1]), int(args[2]), int(args[3]), args[4])
