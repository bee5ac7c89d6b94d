"""Checkpoint I/O benchmark: fsdpx ``ckpt`` against torch.save, safetensors, DCP and raw disk.

    .venv/bin/python benchmarks/ckpt_io.py                            # 1 GiB fp32 state, 5 rounds
    .venv/bin/python benchmarks/ckpt_io.py --size-mib 32 --rounds 2   # smoke run

Everything in one run, one fp32 state of 8 tensors ``[rows, 1024]`` totalling ``--size-mib``:

* save and load throughput (MiB/s): fsdpx (1 and 2 processes), torch.save/torch.load,
  safetensors, torch.distributed.checkpoint (1 and 2 processes), raw disk (``dd conv=fdatasync``
  to write, ``dd`` to read);
* resharding loads, fsdpx and DCP: saved by 2 ranks as Shard(0), loaded by 1 rank whole
  (2->1), and by 2 ranks as Shard(1) (Shard(0)->Shard(1)); with bytes read per rank
  (``/proc/self/io`` ``rchar``: everything the process read, metadata included) over bytes needed;
* how long ``ckpt.save(..., blocking=False)`` blocks the caller, per GiB.

Interleaved: each of ``--rounds`` rounds runs every method once (a save, then a cold load), the
methods of each group in an order rotated by one every round: the 2-process saves and loads
(fresh gloo workers each round), the 2->1 resharding loads, the 1-process methods, ``dd``, the
async save. A burst of load from other processes thus falls on one round of every method rather
than on all repeats of one. Reported: each method's median throughput over the rounds, and the
targets' ratios per round (fsdpx against its anchor in the same round) with their median: on a
shared machine the same-round ratios are the figures that hold, not the absolute times.

Fairness rules: every save ends durable (fsync of each file written: torch.save and safetensors
get an explicit fsync, DCP its own ``sync_files``), and before every load the files' pages are
dropped from the page cache with ``posix_fadvise(DONTNEED)`` (only our files, nobody else's), so
loads read the disk. 2-process runs are gloo processes started by this script (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckpt  # noqa: E402
from fsdpx import Mesh, Spec, strategies  # noqa: E402

COLS, NUM_TENSORS = 1024, 8
MiB = 1 << 20


# ---- helpers ---------------------------------------------------------------------------------------


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    rows = max(2, size_mib * MiB // (4 * COLS * NUM_TENSORS))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(NUM_TENSORS)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(path: Path) -> None:
    """Evict ``path``'s files (recursively) from the page cache; only these files."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rchar() -> tuple[int, int]:
    """Bytes this process read: ``read(2)`` bytes (``rchar``) plus bytes fetched from storage
    (``read_bytes``, which counts mmap page faults after the cache was dropped), whichever is
    larger. ``rchar`` alone misses reads done through mmap; ``read_bytes`` alone misses reads
    served from the page cache."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["read_bytes"])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fresh(work: Path, name: str) -> Path:
    p = work / name
    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return p


def rotated(names: list[str], rnd: int) -> list[str]:
    """``names`` started at position ``rnd`` (mod its length): round ``r``'s order."""
    k = rnd % len(names)
    return names[k:] + names[:k]


# ---- one-process methods -------------------------------------------------------------------------


def single_methods(state) -> dict[str, tuple]:
    """name -> (save(path), load(path), file name): the one-process methods. A load puts every
    tensor on the device ``state`` lives on (with ``--device cuda``: device to host to disk on
    save, disk to host to device on load, each method through its own API)."""
    device = next(iter(state.values())).device

    def torch_save(p):
        torch.save(state, p)
        fsync_file(p)

    def st_save(p):
        from safetensors.torch import save_file

        save_file(state, str(p))
        fsync_file(p)

    def fsdpx_save(p):
        ckpt.save(p, {"params": state}, mesh=Mesh(), strategy=None)

    def dcp_save(p):
        import torch.distributed.checkpoint as dcp

        dcp.save({"params": state}, checkpoint_id=str(p), no_dist=True)

    def torch_load(p):
        torch.load(p, weights_only=True, map_location=device)

    def st_load(p):
        from safetensors.torch import load_file

        load_file(str(p), device=str(device))

    def fsdpx_load(p):
        ckpt.load(p, mesh=Mesh(), strategy=None, like={"params": state})

    def dcp_load(p):
        import torch.distributed.checkpoint as dcp

        target = {"params": {k: torch.empty_like(v) for k, v in state.items()}}
        dcp.load(target, checkpoint_id=str(p), no_dist=True)

    return {
        "torch.save/load": (torch_save, torch_load, "t.pt"),
        "safetensors": (st_save, st_load, "t.safetensors"),
        "fsdpx (1 proc)": (fsdpx_save, fsdpx_load, "fsdpx"),
        "dcp (1 proc)": (dcp_save, dcp_load, "dcp"),
    }


def single_round(state, work: Path, rnd: int) -> dict[str, dict[str, float]]:
    """One save and one cold load of every one-process method, in round ``rnd``'s order."""
    methods, out = single_methods(state), {}
    for name in rotated(list(single_methods(state)), rnd):
        save, load, fname = methods[name]
        path = fresh(work, fname)
        out[name] = {"save_s": timed(lambda: save(path))}
        drop_cache(path)
        out[name]["load_s"] = timed(lambda: load(path))
        fresh(work, fname)
    return out


def dd_round(size: int, work: Path) -> dict[str, float]:
    """``dd`` writing ``size`` bytes durably, then reading them cold."""
    path = fresh(work, "dd.bin")
    count = max(1, size // MiB)
    write = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync"]
    out = {"save_s": timed(lambda: subprocess.run(write, check=True, capture_output=True))}
    drop_cache(path)
    read = ["dd", f"if={path}", "of=/dev/null", "bs=4M"]
    out["load_s"] = timed(lambda: subprocess.run(read, check=True, capture_output=True))
    path.unlink(missing_ok=True)
    return out


def async_round(state, work: Path) -> float:
    """Seconds ``save(blocking=False)`` blocks the caller (snapshot + hand-off)."""
    p = fresh(work, "async")
    t0 = time.perf_counter()
    h = ckpt.save(p, {"params": state}, mesh=Mesh(), strategy=None, blocking=False)
    blocked = time.perf_counter() - t0
    h.wait()
    shutil.rmtree(p)
    return blocked


# ---- two-process methods (gloo workers) ------------------------------------------------------------


def worker(args) -> None:
    """One gloo rank, one round: save its Shard(0) halves (fsdpx and DCP, order rotated by
    ``--round``), then load them back as Shard(0) and as Shard(1), timed, in the same order."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    rank, world = args.rank, 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    coord = ckpt.TorchDistCoordinator()
    dmesh = init_device_mesh("cpu", (world,))
    state = make_state(args.size_mib)
    local = {k: v.chunk(world, 0)[rank].clone() for k, v in state.items()}
    work = Path(args.work)
    res: dict[str, float] = {}

    def barrier_timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def fsdpx_save():
        ckpt.save(work / "fsdpx2", {"params": local}, mesh=Mesh(dp=2), strategy=strategies.zero3(), coordinator=coord)

    def dcp_save():
        dtensors = {k: DTensor.from_local(v, dmesh, [Shard(0)], run_check=False) for k, v in local.items()}
        dcp.save({"params": dtensors}, checkpoint_id=str(work / "dcp2"))

    def measured_load(path: Path, fn) -> tuple[float, int]:
        if rank == 0:
            drop_cache(path)
        dist.barrier()
        r0, t0 = rchar(), time.perf_counter()
        fn()
        r1 = rchar()
        dt, read = time.perf_counter() - t0, max(r1[0] - r0[0], r1[1] - r0[1])
        dist.barrier()
        return dt, read

    zero3, col = strategies.zero3(), (lambda path, ndim: Spec(None, "dp"))
    target0 = {"params": {k: distribute_tensor(torch.empty_like(v), dmesh, [Shard(0)]) for k, v in state.items()}}
    target1 = {"params": {k: distribute_tensor(torch.empty_like(v), dmesh, [Shard(1)]) for k, v in state.items()}}
    saves = {"fsdpx": ("fsdpx2", fsdpx_save), "dcp": ("dcp2", dcp_save)}
    loads = {
        "fsdpx": (lambda: ckpt.load(work / "fsdpx2", mesh=Mesh(dp=2), strategy=zero3, rank=rank),
                  lambda: ckpt.load(work / "fsdpx2", mesh=Mesh(dp=2), strategy=None, specs=col, rank=rank)),
        "dcp": (lambda: dcp.load(target0, checkpoint_id=str(work / "dcp2")),
                lambda: dcp.load(target1, checkpoint_id=str(work / "dcp2"))),
    }
    order = rotated(["fsdpx", "dcp"], args.round)
    for name in order:
        dirname, save = saves[name]
        if rank == 0:
            fresh(work, dirname)
        res[f"{name}_save_s"] = barrier_timed(save)
    for name in order:
        res[f"{name}_load_s"], res[f"{name}_load_read"] = measured_load(work / saves[name][0], loads[name][0])
    for name in order:
        res[f"{name}_s1_s"], res[f"{name}_s1_read"] = measured_load(work / saves[name][0], loads[name][1])
    ok = all(torch.equal(target1["params"][k].to_local(), state[k].chunk(world, 1)[rank]) for k in state)
    res["dcp_s1_ok"] = float(ok)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(res), flush=True)


def run_workers(args, work: Path, rnd: int) -> list[dict[str, float]]:
    """Round ``rnd`` of the two gloo ranks; each rank's results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--port", str(port),
                               "--work", str(work), "--size-mib", str(args.size_mib), "--round", str(rnd)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        if p.returncode:
            raise RuntimeError(f"worker failed:\n{err[-4000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def reshard_2_to_1(state, work: Path, rnd: int) -> dict[str, tuple[float, int]]:
    """Load the 2-rank Shard(0) checkpoints whole in this one process, once each, in round
    ``rnd``'s order: name -> (seconds, bytes read)."""
    import torch.distributed.checkpoint as dcp

    def dcp_load():
        target = {"params": {k: torch.empty_like(v) for k, v in state.items()}}
        dcp.load(target, checkpoint_id=str(work / "dcp2"), no_dist=True)

    loads = {"fsdpx": (work / "fsdpx2", lambda: ckpt.load(work / "fsdpx2", mesh=Mesh(), strategy=None)),
             "dcp": (work / "dcp2", dcp_load)}
    out = {}
    for name in rotated(list(loads), rnd):
        path, fn = loads[name]
        drop_cache(path)
        r0, t0 = rchar(), time.perf_counter()
        fn()
        r1 = rchar()
        out[name] = (time.perf_counter() - t0, max(r1[0] - r0[0], r1[1] - r0[1]))
    return out


def one_round(args, state, work: Path, rnd: int) -> dict:
    """Every method once, groups in a fixed order, methods within a group rotated by ``rnd``.
    With ``--device cuda`` the one-process methods, ``dd`` and the async save only (the
    2-process workers are gloo processes on the host)."""
    if args.device == "cuda":
        single = single_round(state, work, rnd)
        single["raw disk (dd)"] = dd_round(nbytes(state), work)
        return {"methods": single, "async_s": async_round(state, work), "load_1min": os.getloadavg()[0]}
    w = run_workers(args, work, rnd)
    r21 = reshard_2_to_1(state, work, rnd)
    single = single_round(state, work, rnd)
    single["raw disk (dd)"] = dd_round(nbytes(state), work)
    single["fsdpx (2 procs)"] = {"save_s": max(r["fsdpx_save_s"] for r in w), "load_s": max(r["fsdpx_load_s"] for r in w)}
    single["dcp (2 procs)"] = {"save_s": max(r["dcp_save_s"] for r in w), "load_s": max(r["dcp_load_s"] for r in w)}
    return {"methods": single, "async_s": async_round(state, work), "workers": w,
            "reshard_2_to_1": {k: {"s": t, "read": r} for k, (t, r) in r21.items()},
            "load_1min": os.getloadavg()[0]}


# ---- report --------------------------------------------------------------------------------------------


def round_ratios(r: dict, size: int) -> dict[str, float]:
    """The targets' measures in one round: anchor time over fsdpx time (> 1: fsdpx faster)."""
    m, w = r["methods"], r.get("workers")
    f_save = m["fsdpx (1 proc)"]["save_s"]
    if w is None:  # --device cuda: one-process methods only
        return {
            "save vs torch.save": m["torch.save/load"]["save_s"] / f_save,
            "save vs DCP": m["dcp (1 proc)"]["save_s"] / f_save,
            "load vs torch.load": m["torch.save/load"]["load_s"] / m["fsdpx (1 proc)"]["load_s"],
            "load vs DCP": m["dcp (1 proc)"]["load_s"] / m["fsdpx (1 proc)"]["load_s"],
            "async blocks, s per GiB": r["async_s"] / (size / (1 << 30)),
        }
    s1 = {k: max(x[f"{k}_s1_s"] for x in w) for k in ("fsdpx", "dcp")}
    return {
        "save vs torch.save": m["torch.save/load"]["save_s"] / f_save,
        "save vs DCP": m["dcp (1 proc)"]["save_s"] / f_save,
        "save vs DCP, 2 procs": m["dcp (2 procs)"]["save_s"] / m["fsdpx (2 procs)"]["save_s"],
        "2->1 load vs DCP": r["reshard_2_to_1"]["dcp"]["s"] / r["reshard_2_to_1"]["fsdpx"]["s"],
        "Shard(0)->Shard(1) vs DCP": s1["dcp"] / s1["fsdpx"],
        "disk floor (DCP Shard(1) / dd read)": s1["dcp"] / m["raw disk (dd)"]["load_s"],
        "async blocks, s per GiB": r["async_s"] / (size / (1 << 30)),
    }


def report(rounds: list[dict], size: int) -> str:
    mib, lines = size / MiB, []
    lines.append(f"state: {NUM_TENSORS} fp32 tensors, {mib:.0f} MiB; {len(rounds)} interleaved rounds; "
                 "saves fsynced, loads cache-cold; 1-minute load per round: "
                 + " ".join(f"{r['load_1min']:.1f}" for r in rounds))
    lines.append("\n| method | save MiB/s, median [min-max] | load MiB/s, median [min-max] |\n|---|---:|---:|")
    for name in rounds[0]["methods"]:
        cells = []
        for kind in ("save_s", "load_s"):
            v = [mib / r["methods"][name][kind] for r in rounds]
            cells.append(f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    per = [round_ratios(r, size) for r in rounds]
    names = list(per[0])
    lines.append("\n| round | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for i, p in enumerate(per):
        lines.append(f"| {i} | " + " | ".join(f"{p[n]:.2f}" for n in names) + " |")
    lines.append("| median | " + " | ".join(f"**{statistics.median(p[n] for p in per):.2f}**" for n in names) + " |")
    last = rounds[-1]
    if "workers" not in last:
        return "\n".join(lines)
    f21, d21 = (last["reshard_2_to_1"][k]["read"] / size for k in ("fsdpx", "dcp"))
    f_rank = [x["fsdpx_s1_read"] / (size / 2) for x in last["workers"]]
    f_sum, d_sum = (sum(x[f"{k}_s1_read"] for x in last["workers"]) / size for k in ("fsdpx", "dcp"))
    lines.append(f"\nread / need (last round): 2 -> 1 fsdpx {f21:.3f}, DCP {d21:.3f}; Shard(0) -> Shard(1) both "
                 f"ranks together fsdpx {f_sum:.3f}, DCP {d_sum:.3f} (fsdpx per rank "
                 + " / ".join(f"{v:.3f}" for v in f_rank) + ")")
    ok = all(x["dcp_s1_ok"] for r in rounds for x in r["workers"])
    lines.append(f"DCP's Shard(1) load equals the state's Shard(1) halves in every round: {ok}")
    lines.append("targets: save vs torch.save >= 0.9, vs DCP >= 1.5; resharding load vs DCP >= 3; "
                 "async <= 0.3 s per GiB; read / need <= 1.05")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds, each method once per round")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write every round's numbers to this JSON file")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the state lives; cuda: one-process methods, dd and the async save only")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    state = {k: v.to(args.device) for k, v in make_state(args.size_mib).items()}
    work = Path(tempfile.mkdtemp(prefix="ckpt_io_", dir=args.dir))
    rounds = []
    try:
        for rnd in range(args.rounds):
            rounds.append(one_round(args, state, work, rnd))
            print(f"[ckpt_io {time.strftime('%H:%M:%S')}] round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"size": nbytes(state), "device": args.device, "rounds": rounds}, indent=1))
    print(report(rounds, nbytes(state)))


if __name__ == "__main__":
    main()
