"""Pipeline parallelism on 4 gloo processes: fsdpx's schedules vs torch.distributed.pipelining.

    .venv/bin/python benchmarks/pipeline.py [--small] [--nproc 4] [--rounds 6] [--out results.json]

Run plainly, this file is the driver: it launches itself under torchrun (one thread per
process), runs every mode in the same processes (order rotated every round) and prints markdown
tables. Progress goes to stderr.

Every mode trains the SAME GPT (``fsdpx.models.gpt.GPT``, 8 blocks, untied LM head, built from
one seed) on the SAME global batch cut into the same microbatches, with AdamW of the same
hyper-parameters; rank ``r`` runs stage ``r`` (``r`` and ``r + p`` when interleaved):

* ``fsdpx-<kind>``     ``resolve_pipeline(model, ddp plan, PipelineParallel(schedule=kind, ...),
                       Mesh(dp=1, pp=p))``, ``make_sharded_step(..., donate=True)``; kinds gpipe,
                       1f1b, interleaved_1f1b (2 stages per rank), zero_bubble
* ``fsdpx-1f1b-private`` the same 1F1B with ``DPConfig(method="ghost")``: one backward per stage,
                       each microbatch's norms completed by an all-reduce over ``pp``, then its
                       clipped sums at each stage (timed as that stage's ``W``)
* ``torch-<kind>``     ``PipelineStage`` of hand-cut stage modules (embeddings + blocks, blocks,
                       blocks + final norm + head) and ``ScheduleGPipe`` / ``Schedule1F1B`` /
                       ``ScheduleInterleaved1F1B``, ``torch.optim.AdamW``

Step time: the slowest rank's, median over the measured rounds; ratios are medians of same-round
ratios, with their quartiles in brackets (the spread a loaded machine leaves) and the median
ratio of the slowest rank's process CPU time (every thread; waiting costs none). Bubble, for
fsdpx: over the schedule loop (``_Run.execute``: the update and the step's bookkeeping
excluded), per rank the longest loop's time minus the time inside the rank's compute actions
(``F``, ``B``, ``W``, timed as they run), summed over ranks, over ``p x`` the longest loop;
beside it the simulator's (``fsdpx.sharding.schedule_sim.simulate(..., stage_costs=...)``) with
each STAGE's measured median durations of ``F``, ``B`` and ``W`` (an interleaved rank's two
chunks differ: the last holds the LM head), transfers free.
Note: 4 processes on a 2-core machine share cores, so a rank that waits for a core is counted
neither as computing nor as idle by the simulator; the comparison is meaningful only where each
process has a core (``--nproc`` at most the core count, or a GPU machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

FULL = dict(vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_embd=256, tie_weights=False)
SMALL = dict(vocab_size=128, block_size=16, n_layer=8, n_head=2, n_embd=16, tie_weights=False)
GLOBAL_BATCH, MICROBATCHES = 16, 8
LR, WD = 1e-3, 0.01
KINDS = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
TORCH_KINDS = ("gpipe", "1f1b", "interleaved_1f1b")


def log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- worker: the modes ----------------------------------------------------------------------

def make_model(cfg):
    import torch

    from fsdpx.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def make_batch(cfg):
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, cfg["block_size"])
    return torch.randint(0, cfg["vocab_size"], shape, generator=g), torch.randint(0, cfg["vocab_size"], shape, generator=g)


class ActionTimer:
    """Wraps the fsdpx executor's F/B/W methods to time each action on this rank: ``times[kind]``
    every duration, ``by_stage[(kind, stage)]`` the same split by stage."""

    def __init__(self):
        self.active = self.in_loop = False
        self.reset()

    def reset(self):
        self.times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "schedule": []}
        self.by_stage: dict[tuple[str, int], list[float]] = {}

    def install(self):
        import fsdpx.runtime.pipeline as P

        real_execute = P._Run.execute

        def execute(self_, actions):
            t0 = time.perf_counter()
            TIMER.in_loop = True
            try:
                return real_execute(self_, actions)
            finally:
                TIMER.in_loop = False
                if TIMER.active:
                    TIMER.times["schedule"].append(time.perf_counter() - t0)
        P._Run.execute = execute

        # a private pipeline's W: one microbatch's clipped sums at one stage, formed while the
        # rank waits for a receive once its norms are complete (those left for after the loop
        # are no bubble)
        real_clip = P._Run._clip_record

        def clip_record(self_, rec, stage, *a, **k):
            t0 = time.perf_counter()
            try:
                return real_clip(self_, rec, stage, *a, **k)
            finally:
                if TIMER.active and TIMER.in_loop:
                    took = time.perf_counter() - t0
                    TIMER.times["W"].append(took)
                    TIMER.by_stage.setdefault(("W", stage), []).append(took)
        P._Run._clip_record = clip_record

        for kind, name in (("F", "_forward"), ("B", "_backward"), ("W", "_weights")):
            real = getattr(P._Run, name)

            def timed(self_, mb, stage, *a, _real=real, _kind=kind, **k):
                t0 = time.perf_counter()
                try:
                    return _real(self_, mb, stage, *a, **k)
                finally:
                    if TIMER.active:
                        took = time.perf_counter() - t0
                        TIMER.times[_kind].append(took)
                        TIMER.by_stage.setdefault((_kind, stage), []).append(took)
            setattr(P._Run, name, timed)


TIMER = ActionTimer()


def build_fsdpx(kind: str, model, comm, private: bool):
    from fsdpx.models.gpt import token_loss
    from fsdpx.optim import adamw
    from fsdpx.runtime import init_sharded, make_sharded_step
    from fsdpx.sharding import strategies
    from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
    from fsdpx.sharding.tensor_parallel import resolve
    from privacy.step import DPConfig

    mesh = comm.mesh
    v = 2 if kind == "interleaved_1f1b" else 1
    plan = resolve(model, None, strategies.ddp(), mesh)
    plan = resolve_pipeline(model, plan, PipelineParallel(schedule=kind, microbatches=MICROBATCHES, virtual_stages=v),
                            mesh)
    opt = adamw(LR, weight_decay=WD)
    params = {k: p.detach() for k, p in model.named_parameters()}
    shapes = {k: tuple(p.shape) for k, p in params.items()}
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=GLOBAL_BATCH / 1000, method="ghost") \
        if private else None
    step = make_sharded_step(model, token_loss, opt, plan, comm, param_shapes=shapes, config=config,
                             num_examples=1000 if private else None, donate=True)
    holder = [init_sharded(params, opt, plan, comm, key=0, config=config)]

    def run(batch):
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"]

    return run, plan


class _TorchStage(__import__("torch").nn.Module):
    """Blocks ``[a, b)`` of the GPT, with the embeddings in front at stage 0 and the final norm
    and head behind at the last: the hand cut ``torch.distributed.pipelining`` needs."""

    def __init__(self, gpt, a: int, b: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = __import__("torch").nn.ModuleList(gpt.blocks[a:b])
        if last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        import torch

        if self.first:
            pos = torch.arange(x.shape[1])
            x = self.wte(x) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def build_torch(kind: str, model, comm, cut):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from fsdpx.models.gpt import token_loss

    p, rank = dist.get_world_size(), dist.get_rank()
    stages_here = [rank, rank + p] if kind == "interleaved_1f1b" else [rank]
    num_stages = p * len(stages_here)
    stages, params = [], []
    for s in stages_here:
        a, b = cut[s]
        mod = _TorchStage(model, a, b, s == 0, s == num_stages - 1)
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, s, num_stages, torch.device("cpu")))
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)

    def loss_fn(out, y):
        return token_loss(out, y).mean()

    if kind == "interleaved_1f1b":
        sched = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn)
    else:
        sched = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stages[0], MICROBATCHES, loss_fn=loss_fn)
    holds_first = 0 in stages_here
    holds_last = num_stages - 1 in stages_here

    def run(batch):
        x, y = batch
        losses: list = []
        args = (x,) if holds_first else ()
        sched.step(*args, target=y if holds_last else None, losses=losses if holds_last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if losses else float("nan")

    return run


def timed_step(run, batch) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    dist.barrier()
    TIMER.reset()
    TIMER.active = True
    t0, c0 = time.perf_counter(), time.process_time()
    loss = run(batch)
    mine, cpu = time.perf_counter() - t0, time.process_time() - c0
    TIMER.active = False
    compute = sum(sum(TIMER.times[k]) for k in ("F", "B", "W"))
    sched = sum(TIMER.times["schedule"])
    t = torch.tensor([mine, compute, sched, cpu], dtype=torch.float64)
    everyone = [torch.zeros(4, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    walls = [float(e[0]) for e in everyone]
    computes = [float(e[1]) for e in everyone]
    scheds = [float(e[2]) for e in everyone]
    means = {f"{k}{s}": statistics.mean(v) for (k, s), v in TIMER.by_stage.items()}  # e.g. "F2": stage 2's F
    return {"seconds": max(walls), "walls": walls, "computes": computes, "schedule": scheds, "loss": loss,
            "action_means": means, "cpu": max(float(e[3]) for e in everyone)}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fsdpx import Mesh
    from fsdpx.runtime.dist_comm import init_from_env
    from fsdpx.sharding.schedule import schedule
    from fsdpx.sharding.schedule_sim import simulate

    world = int(os.environ["WORLD_SIZE"])
    comm = init_from_env(Mesh(dp=1, pp=world), timeout_s=1800.0)
    rank = comm.rank
    TIMER.install()
    cfg = SMALL if args.small else FULL
    say = log if rank == 0 else (lambda m: None)
    base = make_model(cfg)
    batch = make_batch(cfg)
    modes = args.modes.split(",")
    runs: dict[str, Any] = {}
    plans = {}
    for mode in modes:
        lib, kind = mode.split("-", 1)
        private = kind.endswith("-private")
        kind = kind.removesuffix("-private")
        if lib == "fsdpx":
            runs[mode], plans[mode] = build_fsdpx(kind, copy.deepcopy(base), comm, private)
        else:
            fs = plans.get(f"fsdpx-{kind}") or build_fsdpx(kind, copy.deepcopy(base), comm, False)[1]
            runs[mode] = build_torch(kind, copy.deepcopy(base), comm, [(s[0], s[-1] + 1) for s in fs.pipeline.stages])
        say(f"built {mode}")
    steps: dict[str, list] = {m: [] for m in modes}
    for i in range(args.warmup + args.rounds):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        for mode in order:
            rec = timed_step(runs[mode], batch)
            rec["warmup"] = i < args.warmup
            steps[mode].append(rec)
            say(f"round {i + 1}/{args.warmup + args.rounds} {mode}: {rec['seconds']:.3f}s")
    # the simulator's bubble from every stage's measured median action times (stages are
    # unbalanced: the last also runs the LM head and the loss, and an interleaved rank's chunks
    # differ); each rank measures its own stages
    costs = {}
    for mode in modes:
        if mode.startswith("fsdpx-"):
            measured = [s for s in steps[mode] if not s["warmup"]]
            costs[mode] = {key: statistics.median(s["action_means"].get(key, 0.0) for s in measured)
                           for key in measured[0]["action_means"]}
    all_costs: list = [None] * world
    dist.all_gather_object(all_costs, costs)
    predictions = {}
    for mode in costs:
        kind = mode.split("-", 1)[1].removesuffix("-private")
        v = 2 if kind == "interleaved_1f1b" else 1
        sched = schedule(kind, world, MICROBATCHES, virtual_stages=v)
        merged = {key: t for c in all_costs for key, t in c[mode].items()}
        per_stage = [{k: merged.get(f"{k}{s}", 0.0) for k in ("F", "B", "W")} for s in range(sched.num_stages)]
        if mode.endswith("-private"):  # a W waits for its microbatch's norms: simulated folded into B
            per_stage = [{"F": c["F"], "B": c["B"] + c["W"], "W": 0.0} for c in per_stage]
        predictions[mode] = {"costs": per_stage, "bubble": simulate(sched, stage_costs=per_stage).bubble}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "steps": steps, "predictions": predictions})
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"config": cfg, "ranks": everyone, "world": world}, f)
    dist.barrier()
    dist.destroy_process_group()
    del torch


# ---- driver ---------------------------------------------------------------------------------

def summarize(res: dict) -> str:
    ranks = res["ranks"]
    steps0 = ranks[0]["steps"]
    modes = list(steps0)
    p = res["world"]

    def measured(mode):
        return [s for s in steps0[mode] if not s["warmup"]]

    def ratio(mode, ref):
        """Median of same-round step-time ratios, with their quartiles (the spread a loaded
        machine leaves), and the median ratio of the slowest rank's process CPU time."""
        if ref not in steps0:
            return "-"
        rs = sorted(a["seconds"] / b["seconds"] for a, b in zip(measured(mode), measured(ref)))
        q = statistics.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3
        cpu = statistics.median(a["cpu"] / b["cpu"] for a, b in zip(measured(mode), measured(ref)))
        return f"{statistics.median(rs):.2f}x [{q[0]:.2f}-{q[2]:.2f}] cpu {cpu:.2f}x"

    lines = [f"### {p} processes (Mesh(dp=1, pp={p})), GPT {res['config']}, global batch {GLOBAL_BATCH}, "
             f"{MICROBATCHES} microbatches, fp32, 1 thread per process", "",
             "| mode | step s | vs torch, same schedule | vs fsdpx-1f1b | measured bubble | simulator's bubble "
             "(measured F/B/W) | loss (last round) |", "|---|---|---|---|---|---|---|"]
    for mode in modes:
        ms = measured(mode)
        sec = statistics.median(s["seconds"] for s in ms)
        kind = mode.split("-", 1)[1].removesuffix("-private")
        torch_ref = f"torch-{kind}" if mode.startswith("fsdpx-") and not mode.endswith("-private") else None
        bubble = "-"
        sim = "-"
        if mode.startswith("fsdpx-"):
            # over the schedule loop only (the update and the step's bookkeeping are no bubble):
            # the loops start together after the step's first barrier-free work, so the longest
            # loop is the schedule's makespan
            b = [sum(max(s["schedule"]) - c for c in s["computes"]) / (p * max(s["schedule"])) for s in ms]
            bubble = f"{statistics.median(b):.3f}"
            sim = f"{ranks[0]['predictions'][mode]['bubble']:.3f}"
        loss = ranks[-1]["steps"][mode][-1]["loss"]  # torch reports it on the last stage's rank
        lines.append(f"| {mode} | {sec:.3f} | {ratio(mode, torch_ref) if torch_ref else '-'} | "
                     f"{ratio(mode, 'fsdpx-1f1b')} | {bubble} | {sim} | {loss:.5f} |")
    return "\n".join(lines)


def driver(args) -> None:
    from fsdpx.train.launch import torchrun_command

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = torchrun_command(args.nproc, [__file__, "--worker", "--result", path, "--rounds", str(args.rounds),
                                            "--warmup", str(args.warmup), "--modes", args.modes,
                                            *(["--small"] if args.small else [])])
        log(f"launching {args.nproc} processes")
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(path) as f:
            res = json.load(f)
    text = summarize(res)
    print(text)
    log(f"done in {time.perf_counter() - t0:.0f}s; load average {os.getloadavg()[0]:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**res, "table": text}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default=",".join([*(f"fsdpx-{k}" for k in KINDS), "fsdpx-1f1b-private",
                                                 *(f"torch-{k}" for k in TORCH_KINDS)]))
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
