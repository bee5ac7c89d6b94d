"""Pipeline parallelism on 4 gloo processes: fsdpx's schedules vs torch.distributed.pipelining.

    .venv/bin/python benchmarks/pipeline.py [--small] [--nproc 4] [--rounds 6] [--mem-rounds 2]
                                            [--sched batch] [--out results.json]
    .venv/bin/python benchmarks/pipeline.py --tables results.json ...   # the tables again, no run
    .venv/bin/python benchmarks/pipeline.py --paired results.json ...   # fsdpx / torch pooled

Run plainly, this file is the driver: it launches itself under torchrun (one thread per
process) twice, a timing job and then a memory job, each running every mode in the same
processes (order rotated every round), and prints markdown tables. Progress goes to stderr.

Every mode trains the SAME GPT (``fsdpx.models.gpt.GPT``, 8 blocks, untied LM head, built from
one seed) on the SAME global batch cut into the same microbatches, with AdamW of the same
hyper-parameters; rank ``r`` runs stage ``r`` (``r`` and ``r + p`` when interleaved):

* ``fsdpx-<kind>``     ``resolve_pipeline(model, ddp plan, PipelineParallel(schedule=kind, ...),
                       Mesh(dp=1, pp=p))``, ``make_sharded_step(..., donate=True)``; kinds gpipe,
                       1f1b, interleaved_1f1b (2 stages per rank), zero_bubble
* ``fsdpx-1f1b-private`` the same 1F1B with ``DPConfig(method="ghost")``: one backward per stage,
                       each microbatch's norms completed by an all-reduce over ``pp`` (started at
                       the end of the rank's last ``B`` of it, timed as part of that ``B``), then
                       its clipped sums at each stage (timed as that stage's ``W``; the listed
                       ``W``s do nothing), formed while the rank waits for a message or after
                       the list: its loop runs on to its last ``W`` (``_Run.clip``), and its
                       simulated bubble is ``fsdpx.sharding.private_sim.simulate_private``'s,
                       the all-reduce taking its measured time (from a barrier, median)
* ``torch-<kind>``     ``PipelineStage`` of hand-cut stage modules (embeddings + blocks, blocks,
                       blocks + final norm + head) and ``ScheduleGPipe`` / ``Schedule1F1B`` /
                       ``ScheduleInterleaved1F1B``, ``torch.optim.AdamW``

Step time: the slowest rank's, median over the measured rounds; ratios are medians of same-round
ratios, with their quartiles in brackets (the spread a loaded machine leaves) and the median
ratio of the slowest rank's process CPU time (every thread; waiting costs none). Bubble: over
the schedule loop (fsdpx: ``_Run.execute``; torch: ``schedule.step``; the update and the step's
bookkeeping excluded), per rank the longest loop's time minus the time inside the rank's compute
actions (``F``, ``B``, ``W``, timed as they run; torch's: its stages' ``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk`` and the schedule's loss, which fsdpx's last
stage computes in ``F``), summed over ranks, over ``p x`` the longest loop; for fsdpx, beside it
the simulator's (``fsdpx.sharding.schedule_sim.simulate(..., stage_costs=...)``) with
each STAGE's measured median durations of ``F``, ``B`` and ``W`` (an interleaved rank's two
chunks differ: the last holds the LM head), once with messages free in transit and once with
the transit measured on the same gloo group (``Transfer``: the one-way time of a send/receive
pair, half a ping-pong through ``Comm.post_recv_p2p`` / ``exchange_p2p`` as the executor uses
them, of a one-element message (latency) and of one microbatch's activation (latency plus bytes
over bandwidth), on every neighbouring pair of ranks, after the warm-up and after the last
round; medians over all of them), and a third time adding each rank's own time in a transfer
(its thread's CPU in ``_transfer``: posting receives and sending, per transfer action, median
over the rounds) as the transfer actions' cost on that rank; a fourth time the same on the
host's shared cores (``simulate(..., cores=...)``, the cores this process may run on), each F,
B and W costing its median thread CPU instead of its wall time; and the third's setting with the
measured spread (``spread_prediction``: the mean bubble over 200 draws of every F, B and W from
its stage's durations of that kind over the rounds, ``fsdpx.sharding.schedule_spread``), which the
medians' simulations understate where durations spread (a makespan is a max of sums, convex: its
mean exceeds its value at the mean durations), with the measured bubble's difference from it and
from the medians' third. Then each step replayed
(``simulate(..., action_costs=...)``, on the processes' common monotonic clock): its own F, B
and W durations, transfers free; and with each transfer group's own CPU and the transit
measured in the schedule (sender's group start to the waiting receiver's group end). Where the
rest of the loop goes is reported beside it: per rank, the time inside ``_transfer`` (posting
receives, sending, waiting), its thread CPU and its time runnable but waiting for a core
(``/proc/thread-self/schedstat``'s run delay: on a shared host a rank whose send wakes its peer
can lose its core to it), also shown as a share of the bubble.

Memory (a separate job, with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed activations leave the
resident set, as ``benchmarks/max_batch.py``; marks would not disturb the timing job, the
allocator setting would): for every mode after a warm-up round, each rank's peak RSS over the
schedule loop above the RSS at its start (``VmHWM`` reset through ``/proc/self/clear_refs`` as
the loop starts; fsdpx: ``_Run.execute``; torch: ``schedule.step``, the optimizer excluded),
the largest over ``--mem-rounds`` rounds. Beside it the prediction: the simulator's peak of
activations held (``peak_held_by_rank``: each microbatch in flight at stage ``s`` from its
``F`` to its ``W`` holds what one microbatch's forward of stage ``s`` keeps, counted by
``fsdpx.runtime.step_memory.LiveBytes`` on a real forward of the stage, loss included on the
last) plus the gradients of the rank's parameters (formed in the loop by both libraries).
A private pipeline's prediction is the planner's (``fsdpx.jobs.parallel``): a microbatch holds
its activations from ``F`` to ``B``, then its examples' contributions (factors or per-example
gradients, ``fsdpx.jobs.memory.contribution_bytes_of`` on a real microbatch of the whole GPT,
grouped by stage) until the ``W`` the private policy forms, on ``simulate_private`` with equal
costs (``private_held_by_rank``); where a rank waits and forms ``W``s early it holds less.
``--sched batch`` runs every process under ``SCHED_BATCH``, which the kernel never lets preempt a
running process on wakeup: on a host with fewer cores than processes, a rank whose send wakes its
peer keeps its core (the peer waits for a free core or the scheduler's tick), as it would with a
core each. Both libraries run under the same policy.
Note: 4 processes on a 2-core machine share cores. The shared-core simulation charges each
action its CPU and lets busy ranks share the cores; what it cannot see is gloo's delivery on an
oversubscribed host (a message whose receive was posted can wait for both ranks' I/O threads
to get a core: tens of ms, now and then), so the comparison is meaningful only where each
process has a core (``--nproc`` at most the core count, or a GPU machine's host).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import statistics
import time
from typing import Any

from bench_common import logger, random_token_batch, seeded_gpt

FULL = dict(vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_embd=256, tie_weights=False)
SMALL = dict(vocab_size=128, block_size=16, n_layer=8, n_head=2, n_embd=16, tie_weights=False)
GLOBAL_BATCH, MICROBATCHES = 16, 8
LR, WD = 1e-3, 0.01
KINDS = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
TORCH_KINDS = ("gpipe", "1f1b", "interleaved_1f1b")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks >= 64 KiB go back to the OS
# --malloc keep (timing job): glibc serves every block from its heap and never gives freed memory
# back, so no step's temporaries land on freshly mapped pages (no first-touch page faults), for
# any size. Without it the processes run with glibc's defaults, whose thresholds fsdpx's
# PipelineStep raises once (fsdpx/runtime/host_heap.py: blocks up to 32 MiB stay mapped).
KEEP_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296",
            "MALLOC_TOP_PAD_": "268435456"}
PING_REPS = 20


def run_delay() -> float:
    """Seconds this thread has spent runnable but waiting for a core (Linux schedstat's run
    delay; 0 where the kernel does not report it)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


log = logger("pipeline")


# ---- worker: the modes ----------------------------------------------------------------------

class ActionTimer:
    """Wraps the fsdpx executor's F/B/W methods to time each action on this rank: ``times[kind]``
    every duration, ``by_stage[(kind, stage)]`` the same split by stage."""

    def __init__(self):
        self.active = self.in_loop = False
        self.reset()

    def reset(self):
        self.times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "schedule": [], "T": [], "Tcpu": [],
                                              "Tdelay": []}
        self.by_stage: dict[tuple[str, int], list[float]] = {}
        self.cpu_by_stage: dict[tuple[str, int], list[float]] = {}  # fsdpx: each action's thread CPU
        self.events: list[tuple[str, int, int, float, float]] = []  # (kind, mb, stage, start, end), F/B/W
        self.loop: list[float] = []  # the schedule loop's start and end
        self.groups: list = []  # transfer groups: (start, end, thread CPU, [(kind, mb, stage, peer), ...])
        self.clip_wall = self.clip_cpu = 0.0  # a private pipeline's W's so far (formed inside transfer groups)
        self.norms_done: list = []  # a private pipeline: when each microbatch's norms were complete here
        self.clips: dict[int, int] = {}  # a private pipeline: W's formed so far, per stage

    def install(self):
        import fsdpx.runtime.pipeline as P

        real_execute = P._Run.execute

        def execute(self_, actions):
            t0 = time.perf_counter()
            TIMER.in_loop = True
            try:
                with MEM.window():
                    return real_execute(self_, actions)
            finally:
                TIMER.in_loop = False
                if TIMER.active:
                    t1 = time.perf_counter()
                    TIMER.times["schedule"].append(t1 - t0)
                    TIMER.loop = [t0, t1]
        P._Run.execute = execute

        # a private pipeline's loop goes on after the list: the W's of the microbatches whose
        # norms were not complete while it waited (``_Run.clip``) are part of its schedule
        real_clip_all = P._Run.clip

        def clip(self_):
            TIMER.in_loop = True
            try:
                return real_clip_all(self_)
            finally:
                TIMER.in_loop = False
                if TIMER.active and self_.o.early_norms:
                    t1 = time.perf_counter()
                    TIMER.times["schedule"][-1] = t1 - TIMER.loop[0]
                    TIMER.loop = [TIMER.loop[0], t1]
        P._Run.clip = clip

        # transfer groups: wall time (posting receives, sending, waiting) and this thread's CPU,
        # without the private W's formed while waiting (timed as W's)
        real_transfer = P._Run._transfer

        def transfer(self_, actions, *a, **k):
            t0, c0, w0, cw0 = time.perf_counter(), time.thread_time(), TIMER.clip_wall, TIMER.clip_cpu
            d0 = run_delay()
            try:
                return real_transfer(self_, actions, *a, **k)
            finally:
                if TIMER.active:
                    t1 = time.perf_counter()
                    cpu = time.thread_time() - c0 - (TIMER.clip_cpu - cw0)
                    TIMER.times["T"].append(t1 - t0 - (TIMER.clip_wall - w0))
                    TIMER.times["Tcpu"].append(cpu)
                    # runnable, waiting for a core (a shared host: a rank whose send woke its
                    # peer can lose its core to it), not for a message
                    TIMER.times["Tdelay"].append(run_delay() - d0)
                    TIMER.groups.append((t0, t1, cpu, [(x.kind, x.mb, x.stage, x.peer) for x in actions]))
        P._Run._transfer = transfer

        # a private rank's last B of a microbatch goes on to start its norms' all-reduce (summing
        # its stages' squared norms, launching the collective): timed as part of that B
        real_norms = P._Run._start_norms

        def start_norms(self_, mb):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real_norms(self_, mb)
            finally:
                if TIMER.active:
                    took, cpu = time.perf_counter() - t0, time.thread_time() - c0
                    kind, mb_, stage, b0, b1 = TIMER.events[-1]
                    assert kind == "B" and mb_ == mb, TIMER.events[-1]
                    TIMER.events[-1] = (kind, mb_, stage, b0, b1 + took)
                    TIMER.times["B"][-1] += took
                    TIMER.by_stage[("B", stage)][-1] += took
                    TIMER.cpu_by_stage[("B", stage)][-1] += cpu
        P._Run._start_norms = start_norms

        # when each microbatch's norms' all-reduce completes on this rank (a callback on gloo's
        # thread): its time in the schedule, where the ranks' threads compete for cores
        real_start = P.PipelineStep.start_norms

        def start_norms_async(self_, sq):
            handle = real_start(self_, sq)
            if TIMER.active and getattr(handle, "work", None) is not None:
                k = len(TIMER.norms_done)
                TIMER.norms_done.append(None)

                def done(_fut, k=k):
                    TIMER.norms_done[k] = time.perf_counter()
                handle.work.get_future().then(done)
            return handle
        P.PipelineStep.start_norms = start_norms_async

        # a private pipeline's W: one microbatch's clipped sums at one stage, formed while the
        # rank waits for a receive once its norms are complete, or after the list (``clip``)
        real_clip = P._Run._clip_record

        def clip_record(self_, rec, stage, *a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real_clip(self_, rec, stage, *a, **k)
            finally:
                if TIMER.active and TIMER.in_loop:
                    t1 = time.perf_counter()
                    took = t1 - t0
                    # one stage's W's are formed in microbatch order: the k-th is microbatch k's
                    k = TIMER.clips.get(stage, 0)
                    TIMER.clips[stage] = k + 1
                    TIMER.events.append(("W", k, stage, t0, t1))
                    TIMER.clip_wall += took
                    TIMER.clip_cpu += time.thread_time() - c0
                    TIMER.times["W"].append(took)
                    TIMER.by_stage.setdefault(("W", stage), []).append(took)
                    TIMER.cpu_by_stage.setdefault(("W", stage), []).append(time.thread_time() - c0)
        P._Run._clip_record = clip_record

        for kind, name in (("F", "_forward"), ("B", "_backward"), ("W", "_weights")):
            real = getattr(P._Run, name)

            def timed(self_, mb, stage, *a, _real=real, _kind=kind, **k):
                if _kind == "W" and self_.o.config is not None:  # private: the listed W does nothing,
                    return _real(self_, mb, stage, *a, **k)  # its W is the clipped sum (clip_record)
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return _real(self_, mb, stage, *a, **k)
                finally:
                    if TIMER.active:
                        t1 = time.perf_counter()
                        TIMER.times[_kind].append(t1 - t0)
                        TIMER.by_stage.setdefault((_kind, stage), []).append(t1 - t0)
                        TIMER.cpu_by_stage.setdefault((_kind, stage), []).append(time.thread_time() - c0)
                        TIMER.events.append((_kind, mb, stage, t0, t1))
            setattr(P._Run, name, timed)

        # torch's stages: the same F/B/W split (its loss, computed by the schedule, in F as
        # fsdpx's last stage computes it in F), so its loop splits into compute and the rest
        from torch.distributed.pipelining import schedules as TS, stage as TG

        for kind, owner, name in (("F", TG._PipelineStageBase, "forward_one_chunk"),
                                  ("B", TG._PipelineStageBase, "backward_one_chunk"),
                                  ("W", TG._PipelineStageBase, "backward_weight_one_chunk"),
                                  ("F", TS._PipelineSchedule, "_maybe_compute_loss")):
            real = getattr(owner, name)

            def timed_torch(self_, *a, _real=real, _kind=kind, **k):
                t0 = time.perf_counter()
                try:
                    return _real(self_, *a, **k)
                finally:
                    if TIMER.active:
                        took = time.perf_counter() - t0
                        TIMER.times[_kind].append(took)
                        # per stage, as fsdpx's: the schedule's loss ("L") takes the stage first
                        stage = getattr(self_, "stage_index", None)
                        key = (_kind, stage) if stage is not None else ("L", a[0].stage_index)
                        TIMER.by_stage.setdefault(key, []).append(took)
            setattr(owner, name, timed_torch)


TIMER = ActionTimer()


class MemWindow:
    """Peak RSS over a window above the RSS as it opens (memory job only): ``window()``
    resets ``VmHWM`` through ``/proc/self/clear_refs`` and reads ``VmRSS``, and on exit adds
    ``VmHWM - VmRSS at the start`` to ``peaks`` while ``active``."""

    def __init__(self):
        self.active = False
        self.peaks: list[int] = []  # bytes

    @__import__("contextlib").contextmanager
    def window(self):
        if not self.active:
            yield
            return
        from bench_common import reset_hwm, status_kb

        if not reset_hwm():
            raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): no peak over the schedule")
        base = status_kb("VmRSS")
        yield
        self.peaks.append((status_kb("VmHWM") - base) * 1024)


MEM = MemWindow()


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
        t0 = time.perf_counter()
        with MEM.window():
            sched.step(*args, target=y if holds_last else None, losses=losses if holds_last else None)
        TIMER.times["schedule"].append(time.perf_counter() - t0)
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
    t = torch.tensor([mine, compute, sched, cpu, sum(TIMER.times["T"]), sum(TIMER.times["Tcpu"]),
                      sum(TIMER.times["Tdelay"])], dtype=torch.float64)
    everyone = [torch.zeros(7, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    walls = [float(e[0]) for e in everyone]
    computes = [float(e[1]) for e in everyone]
    scheds = [float(e[2]) for e in everyone]
    means = {f"{k}{s}": statistics.mean(v) for (k, s), v in TIMER.by_stage.items()}  # e.g. "F2": stage 2's F
    cpu_means = {f"{k}{s}": statistics.mean(v) for (k, s), v in TIMER.cpu_by_stage.items()}
    return {"seconds": max(walls), "walls": walls, "computes": computes, "schedule": scheds, "loss": loss,
            "action_means": means, "action_cpu_means": cpu_means, "cpu": max(float(e[3]) for e in everyone),
            "transfer": [float(e[4]) for e in everyone], "transfer_cpu": [float(e[5]) for e in everyone],
            "transfer_core_wait": [float(e[6]) for e in everyone],
            "events": TIMER.events, "loop": TIMER.loop, "groups": TIMER.groups,
            "norms_done": list(TIMER.norms_done)}


def one_way_seconds(comm, shape, dtype, reps: int) -> list[float]:
    """One-way times of a message of ``shape`` on every neighbouring pair ``(r, r + 1 mod p)``
    in turn (the others wait at a barrier): half of each ping-pong's round trip, through the
    executor's own calls (receives posted before the matching send leaves, as
    ``Comm.post_recv_p2p`` does two transfer groups ahead). Every rank returns every pair's."""
    import torch
    import torch.distributed as dist

    p, me = comm.mesh.size, comm.rank
    out: list[float] = []
    for a in range(p if p > 2 else 1):
        b = (a + 1) % p
        dist.barrier()
        mine = []
        if me == b:
            ahead = comm.post_recv_p2p([(a, shape, dtype)])[0]
        for i in range(reps + 1):  # the first round trip warms the pair's connection up
            if me == a:
                back = comm.post_recv_p2p([(b, shape, dtype)])[0]
                t0 = time.perf_counter()
                comm.exchange_p2p([(b, torch.zeros(shape, dtype=dtype))], [])
                back.wait()
                if i:
                    mine.append((time.perf_counter() - t0) / 2)
                comm.flush_p2p()
            elif me == b:
                got = ahead.wait()
                if i < reps:
                    ahead = comm.post_recv_p2p([(a, shape, dtype)])[0]
                comm.exchange_p2p([(a, got)], [])
                comm.flush_p2p()
        everyone: list = [None] * p
        dist.all_gather_object(everyone, mine)
        out += everyone[a]
    return out


def all_reduce_seconds(comm, shape, dtype, reps: int) -> list[float]:
    """Times of the private pipeline's norms all-reduce (one microbatch's squared norms summed
    over the pipeline ranks, ``Comm.run_async`` as ``PipelineStep.start_norms`` calls it), each
    from a barrier to its end on this rank; every rank returns everyone's."""
    import torch
    import torch.distributed as dist

    from fsdpx.sharding.collectives import cached_plan
    from fsdpx.sharding.spec import Spec

    src = Spec.replicated(1)
    (c,) = cached_plan(src.with_partial(("pp",)), src, tuple(shape), comm.mesh, dtype)
    mine = []
    for i in range(reps + 1):  # the first warms the collective up
        dist.barrier()
        t0 = time.perf_counter()
        comm.run_async(c, torch.ones(shape, dtype=dtype)).wait()
        if i:
            mine.append(time.perf_counter() - t0)
    everyone: list = [None] * comm.mesh.size
    dist.all_gather_object(everyone, mine)
    return [t for ts in everyone for t in ts]


def kept_bytes(stage_module, x, y, last: bool, split: bool) -> int:
    """Bytes one microbatch keeps at a stage, counted by ``LiveBytes`` on a real forward (its
    received input included; the loss at the last stage, whose logits the graph does not keep).
    ``split`` (zero-bubble): the forward also keeps every parameter-owning module's output for
    ``W`` (``fsdpx.runtime.weight_pass.capturing``), and ``B`` leaves their gradients, the
    received gradient and the input gradient sent back: the larger of what is held before and
    after ``B``."""
    import torch

    from fsdpx.models.gpt import token_loss
    from fsdpx.runtime.step_memory import LiveBytes
    from fsdpx.runtime.weight_pass import capturing, input_grads

    mode = LiveBytes()
    names = [n for n, _ in stage_module.named_parameters()] if split else []
    with mode:
        inp = x.clone().requires_grad_(x.is_floating_point())
        with capturing(stage_module, names) as calls:
            out = stage_module(inp)
        if last:
            root, grad_out = token_loss(out, y).sum(), None
            del out
        else:
            root, grad_out = out, torch.randn(out.shape)
        after_forward = mode.live
        if not split:
            return after_forward
        g_in = input_grads(root, grad_out, inp if inp.requires_grad else None, calls)
        after_backward = mode.live
    del root, grad_out, g_in, inp, calls
    return max(after_forward, after_backward)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fsdpx import Mesh
    from fsdpx.runtime.dist_comm import init_from_env
    from fsdpx.sharding.schedule import P2P, schedule
    from fsdpx.sharding.private_sim import simulate_private
    from fsdpx.sharding.schedule_sim import peak_held_by_rank, simulate

    world = int(os.environ["WORLD_SIZE"])
    comm = init_from_env(Mesh(dp=1, pp=world), timeout_s=1800.0)
    rank = comm.rank
    TIMER.install()
    cfg = SMALL if args.small else FULL
    say = log if rank == 0 else (lambda m: None)
    base = seeded_gpt(cfg)
    batch = random_token_batch(cfg, GLOBAL_BATCH)
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
    mb = GLOBAL_BATCH // MICROBATCHES
    hidden = (mb, cfg["block_size"], cfg["n_embd"])
    memory = args.job == "memory"
    rounds = args.warmup + (args.mem_rounds if memory else args.rounds)
    steps: dict[str, list] = {m: [] for m in modes}
    peaks: dict[str, list[int]] = {m: [] for m in modes}
    ping: dict[str, list[float]] = {"latency": [], "activation": [], "norms": []}

    def measure_transit():
        ping["latency"].extend(one_way_seconds(comm, (1,), torch.float32, PING_REPS))
        ping["activation"].extend(one_way_seconds(comm, hidden, torch.float32, PING_REPS))
        ping["norms"].extend(all_reduce_seconds(comm, (mb,), torch.float32, PING_REPS))

    for i in range(rounds):
        if not memory and i == args.warmup:  # transit on the same gloo group, before and after the rounds
            measure_transit()
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        for mode in order:
            MEM.active, MEM.peaks = memory and i >= args.warmup, []
            rec = timed_step(runs[mode], batch)
            if MEM.active:
                peaks[mode].append(max(MEM.peaks))
            MEM.active = False
            rec["warmup"] = i < args.warmup
            steps[mode].append(rec)
            say(f"{args.job} round {i + 1}/{rounds} {mode}: {rec['seconds']:.3f}s")
    if not memory:
        measure_transit()
    result: dict[str, Any] = {"rank": rank}
    if memory:
        # what one microbatch keeps at each of this rank's stages (the same blocks for both
        # libraries), and the rank's gradient bytes
        gen = torch.Generator().manual_seed(2)
        kept, grads = {}, {}
        for mode in modes:
            kind = mode.split("-", 1)[1].removesuffix("-private")
            v = 2 if kind == "interleaved_1f1b" else 1
            fs = plans.get(f"fsdpx-{kind}") or build_fsdpx(kind, copy.deepcopy(base), comm, False)[1]
            cut = [(st[0], st[-1] + 1) for st in fs.pipeline.stages]
            here = [rank + j * world for j in range(v)]
            for s in here:
                if (kind, s) in kept:
                    continue
                first, last = s == 0, s == len(cut) - 1
                mod = _TorchStage(base, *cut[s], first, last)
                x = batch[0][:mb] if first else torch.randn(hidden, generator=gen)
                kept[(kind, s)] = kept_bytes(mod, x, batch[1][:mb], last, split=kind == "zero_bubble")
                grads[(kind, s)] = sum(q.numel() * q.element_size() for q in mod.parameters())
        result["memory"] = {"peaks": peaks, "kept": {f"{k}:{s}": b for (k, s), b in kept.items()},
                            "grads": {f"{k}:{s}": b for (k, s), b in grads.items()}}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            from fsdpx.jobs.memory import contribution_bytes_of
            from fsdpx.jobs.parallel import stage_of_modules
            from fsdpx.models.gpt import token_loss
            from fsdpx.sharding.private_sim import private_held_by_rank

            predictions = {}
            kept_all = {k: b for r in everyone for k, b in r["memory"]["kept"].items()}
            grads_all = {k: b for r in everyone for k, b in r["memory"]["grads"].items()}
            for mode in modes:
                kind = mode.split("-", 1)[1].removesuffix("-private")
                v = 2 if kind == "interleaved_1f1b" else 1
                sched = schedule(kind, world, MICROBATCHES, virtual_stages=v)
                per_stage = [kept_all[f"{kind}:{s}"] for s in range(sched.num_stages)]
                g = [sum(grads_all[f"{kind}:{s}"] for s in range(r, sched.num_stages, world)) for r in range(world)]
                if mode.endswith("-private"):
                    # the planner's model (fsdpx.jobs.parallel): activations from F to B, then the
                    # contributions (counted on a real microbatch) until the W the private policy
                    # forms, on simulate_private with equal costs
                    con = contribution_bytes_of(base, token_loss, (batch[0][:mb], batch[1][:mb]),
                                                stage_of_modules(base, plans[mode]), sched.num_stages)
                    timeline = simulate_private(sched)
                    predictions[mode] = {"kept_per_stage": per_stage, "contributions_per_stage": list(con),
                                         "activations": list(private_held_by_rank(timeline, per_stage, con)),
                                         "grads": g, "in_flight": list(timeline.peak_in_flight_by_rank)}
                    continue
                held = peak_held_by_rank(sched, per_stage)
                predictions[mode] = {"kept_per_stage": per_stage, "activations": list(held), "grads": g,
                                     "in_flight": list(simulate(sched).peak_in_flight_by_rank)}
            with open(args.result, "w") as f:
                json.dump({"config": cfg, "ranks": everyone, "world": world, "predictions": predictions}, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    # the simulator's bubble from every stage's measured median action times (stages are
    # unbalanced: the last also runs the LM head and the loss, and an interleaved rank's chunks
    # differ); each rank measures its own stages
    costs = {}
    for mode in modes:
        if mode.startswith("fsdpx-"):
            measured = [s for s in steps[mode] if not s["warmup"]]
            costs[mode] = {key: statistics.median(s["action_means"].get(key, 0.0) for s in measured)
                           for key in measured[0]["action_means"]}
            costs[mode + ":cpu"] = {key: statistics.median(s["action_cpu_means"].get(key, 0.0) for s in measured)
                                    for key in measured[0]["action_cpu_means"]}
    all_costs: list = [None] * world
    dist.all_gather_object(all_costs, costs)
    small, act = statistics.median(ping["latency"]), statistics.median(ping["activation"])
    act_bytes = mb * cfg["block_size"] * cfg["n_embd"] * 4
    transit = ping_transfer(small, act, act_bytes)
    norms_s = statistics.median(ping["norms"])
    predictions = {"transit": {"latency_s": small, "activation_s": act, "activation_bytes": act_bytes,
                               "delay_s": transit.delay, "norms_s": norms_s}}
    cores = len(os.sched_getaffinity(0))
    predictions["cores"] = cores
    for mode in (m for m in costs if not m.endswith(":cpu")):
        kind = mode.split("-", 1)[1].removesuffix("-private")
        v = 2 if kind == "interleaved_1f1b" else 1
        sched = schedule(kind, world, MICROBATCHES, virtual_stages=v)
        # each rank's own time in a transfer (posting receives, sending: its thread's CPU in
        # transfer groups per transfer action), which the simulator's transfer costs charge
        # to the rank: measured, per rank
        measured = [s for s in steps[mode] if not s["warmup"]]
        occupancy = []
        for r in range(world):
            n = sum(isinstance(a, P2P) for a in sched.ranks[r])
            per = statistics.median(s["transfer_cpu"][r] for s in measured) / n if n else 0.0
            occupancy.append({k: per for k in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")})
        def stage_costs(key):
            merged = {k: t for c in all_costs for k, t in c[key].items()}
            return [{k: merged.get(f"{k}{s}", 0.0) for k in ("F", "B", "W")} for s in range(sched.num_stages)]
        per_stage, per_stage_cpu = stage_costs(mode), stage_costs(mode + ":cpu")
        # a private W (its clipped sums) waits for its microbatch's norms and fills the rank's
        # waits for messages (simulate_private: the executor's policy, the norms' all-reduce
        # taking its measured time)
        private = mode.endswith("-private")
        sim = functools.partial(simulate_private, norms=norms_s) if private else simulate
        predictions[mode] = {"costs": per_stage, "cpu_costs": per_stage_cpu, "occupancy": occupancy,
                             "bubble": sim(sched, stage_costs=per_stage).bubble,
                             "bubble_transit": sim(sched, stage_costs=per_stage, transfer=transit).bubble,
                             "bubble_occupied": sim(sched, rank_costs=occupancy, stage_costs=per_stage,
                                                    transfer=transit).bubble,
                             # the host's cores shared by the ranks: each action's CPU work
                             "bubble_cores": sim(sched, rank_costs=occupancy, stage_costs=per_stage_cpu,
                                                 transfer=transit, cores=cores).bubble}
        if private:  # the model before the policy: each W on the path, right after its B
            folded = [{"F": c["F"], "B": c["B"] + c["W"], "W": 0.0} for c in per_stage]
            predictions[mode]["bubble_w_on_path"] = simulate(sched, rank_costs=occupancy, stage_costs=folded,
                                                             transfer=transit).bubble
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "steps": steps, "predictions": predictions})
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"config": cfg, "ranks": everyone, "world": world}, f)
    dist.barrier()
    dist.destroy_process_group()
    del torch


# ---- driver ---------------------------------------------------------------------------------

def replay(res: dict, mode: str, i: int, transit) -> dict[str, float]:
    """Step ``i`` of ``mode`` on the common clock (``perf_counter`` is the machine's monotonic
    clock, shared by the processes): its makespan from the first rank's loop start to the last
    one's end, the spread of the loop starts, and the simulator's replay of that step with every
    F, B and W lasting what it lasted (``simulate(..., action_costs=...)``, transit free):
    the schedule's model with the step's own durations instead of medians; and again with each
    transfer group's own thread CPU charged to its first action and ``transit`` (a ``Transfer``)
    between ranks. A private step is replayed by ``simulate_private``, its norms' all-reduce
    taking the median measured from a barrier, then (with ``transit``) its median in the step
    (``norms_in_schedule``)."""
    from fsdpx.sharding.private_sim import simulate_private
    from fsdpx.sharding.schedule import RECV_B, RECV_F, SEND_B, SEND_F, B, F, W, schedule
    from fsdpx.sharding.schedule_sim import simulate

    p = res["world"]
    kind = mode.split("-", 1)[1]
    steps = [r["steps"][mode][i] for r in res["ranks"]]
    run = in_schedule = simulate
    if kind.endswith("-private"):  # its W's where the executor's policy puts them
        kind = kind.removesuffix("-private")
        run = functools.partial(simulate_private, norms=res["ranks"][0]["predictions"]["transit"]["norms_s"])
        in_schedule = functools.partial(simulate_private, norms=norms_in_schedule(steps) or 0.0)
    sched = schedule(kind, p, MICROBATCHES, virtual_stages=2 if kind == "interleaved_1f1b" else 1)
    starts, ends = [s["loop"][0] for s in steps], [s["loop"][1] for s in steps]
    cls = {"F": F, "B": B, "W": W, "SEND_F": SEND_F, "RECV_F": RECV_F, "SEND_B": SEND_B, "RECV_B": RECV_B}
    own = {cls[k](mb, st): t1 - t0 for s in steps for k, mb, st, t0, t1 in s["events"]}
    sim = run(sched, {k: 0 for k in ("F", "B", "W")}, action_costs=own)
    # each transfer group's own CPU charged to its first action (posting and sending come first)
    occupied = {cls[g[0][0]](*g[0][1:]): cpu for s in steps for _, _, cpu, g in s["groups"]}
    in_situ = in_schedule(sched, {k: 0 for k in ("F", "B", "W")}, action_costs={**own, **occupied}, transfer=transit)
    makespan = max(ends) - min(starts)
    compute = sum(own.values())
    return {"makespan": makespan, "skew": max(starts) - min(starts), "bubble": 1 - compute / (p * makespan),
            "replay_makespan": sim.makespan, "replay_bubble": sim.bubble,
            "replay_transit_makespan": in_situ.makespan, "replay_transit_bubble": in_situ.bubble}


def ping_transfer(latency_s: float, activation_s: float, activation_bytes: int):
    """The ``Transfer`` of the ping-pongs: a one-element message's one-way time as latency, the
    rest of one activation's time spread over its bytes beyond the element's."""
    from fsdpx.sharding.schedule_sim import Transfer

    return Transfer(latency=latency_s, seconds_per_byte=max(activation_s - latency_s, 0.0) / (activation_bytes - 4),
                    message_bytes=activation_bytes)


def spread_prediction(res: dict, mode: str):
    """The simulator's bubble for ``mode`` with the measured spread
    (``fsdpx.sharding.schedule_spread.sampled_bubble``, 200 draws): the setting of the
    medians' third simulation (ping-pong transit, each rank's CPU per transfer, a private W
    where the executor's policy forms it), every F, B and W drawn from its stage's durations of
    that kind over the measured rounds, on every rank. Needs no rerun: the JSON has them."""
    from fsdpx.sharding.private_sim import simulate_private
    from fsdpx.sharding.schedule import schedule
    from fsdpx.sharding.schedule_sim import simulate
    from fsdpx.sharding.schedule_spread import sampled_bubble

    pred = res["ranks"][0]["predictions"]
    tr = pred["transit"]
    transit = ping_transfer(tr["latency_s"], tr["activation_s"], tr["activation_bytes"])
    kind = mode.split("-", 1)[1]
    private = kind.endswith("-private")
    kind = kind.removesuffix("-private")
    sched = schedule(kind, res["world"], MICROBATCHES, virtual_stages=2 if kind == "interleaved_1f1b" else 1)
    samples: dict[tuple[str, int], list[float]] = {}
    for r in res["ranks"]:
        for s in r["steps"][mode]:
            for k, _, stage, t0, t1 in ([] if s["warmup"] else s["events"]):
                if k in ("F", "B", "W"):
                    samples.setdefault((k, stage), []).append(t1 - t0)
    sim = functools.partial(simulate_private, norms=tr.get("norms_s", 0.0)) if private else simulate
    return sampled_bubble(sched, samples, simulator=sim, rank_costs=pred[mode]["occupancy"],
                          stage_costs=pred[mode]["costs"], transfer=transit)


def norms_in_schedule(steps: list[dict]) -> float | None:
    """A private step's norms' all-reduce as it ran: for each microbatch and rank, from the
    end of the microbatch's last ``B`` on any rank (its last all-reduce start) to the
    completion on that rank (a callback on gloo's thread); the median, or None without any."""
    last_b: dict[int, float] = {}
    for s in steps:
        for kind, mb, _, _, t1 in s["events"]:
            if kind == "B":
                last_b[mb] = max(last_b.get(mb, t1), t1)
    # the last B's end includes starting its all-reduce, which can complete before that call
    # returns: such a completion counts as immediate
    waits = [max(t - last_b[mb], 0.0) for s in steps for mb, t in enumerate(s.get("norms_done", [])) if t is not None]
    return statistics.median(waits) if waits else None


def transit_in_schedule(res: dict, mode: str, i: int) -> list[float]:
    """Step ``i``'s messages that a receiver waited for, on the common clock: from the start of
    the sender's transfer group (its receives posted, then its sends leave) to the end of the
    receiver's group, for each receive whose group began before the message was sent (one that
    began later shows only an upper bound, left out). What a message costs its receiver in
    the schedule, while the other ranks compute, against the ping-pong's idle pair."""
    sent, waited = {}, []
    for r in res["ranks"]:
        for t0, t1, _, actions in r["steps"][mode][i]["groups"]:
            for kind, mb, st, _ in actions:
                if kind == "SEND_F":
                    sent[("F", mb, st + 1)] = t0
                elif kind == "SEND_B":
                    sent[("B", mb, st - 1)] = t0
                else:
                    waited.append(((kind[-1], mb, st), t0, t1))
    return [t1 - sent[key] for key, t0, t1 in waited if key in sent and t0 < sent[key]]


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values`` (binomial order statistics:
    the k-th smallest and k-th largest, k the largest with P(Bin(n, 1/2) < k) <= (1 - level) / 2),
    at least ``level`` coverage; the extremes when n is too small for that."""
    xs, n = sorted(values), len(values)
    tail, k, below = (1 - level) / 2, 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2 ** n <= tail:
        below += math.comb(n, k) / 2 ** n
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def ratio_summary(ratios: list[float]) -> tuple[float, float, float, float, float, int]:
    """``(median, first quartile, third quartile, interval low, interval high, ratios < 1)`` of
    same-round fsdpx / reference ratios (the interval: ``median_interval``)."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return (statistics.median(ratios), q[0], q[2], *median_interval(ratios), sum(r < 1 for r in ratios))


def paired(paths: list[str]) -> str:
    """fsdpx / torch step-time ratios of the same rounds pooled over the timing jobs of
    ``paths`` (``--out`` files of runs with the same nproc), per schedule both ran: median,
    quartiles, the median's 95% interval, rounds where fsdpx was faster."""
    pooled: dict[str, list[float]] = {}
    for path in paths:
        with open(path) as f:
            steps = json.load(f)["timing"]["ranks"][0]["steps"]
        for mode in steps:
            kind = mode.split("-", 1)[1]
            if mode.startswith("fsdpx-") and f"torch-{kind}" in steps:
                mine = [s for s in steps[mode] if not s["warmup"]]
                ref = [s for s in steps[f"torch-{kind}"] if not s["warmup"]]
                pooled.setdefault(kind, []).extend(a["seconds"] / b["seconds"] for a, b in zip(mine, ref))
    lines = ["| schedule | rounds | fsdpx / torch: median [quartiles] | 95% interval of the median | fsdpx faster |",
             "|---|---|---|---|---|"]
    for kind, rs in pooled.items():
        med, q1, q3, lo, hi, faster = ratio_summary(rs)
        lines.append(f"| {kind} | {len(rs)} | {med:.3f} [{q1:.3f}-{q3:.3f}] | {lo:.3f}-{hi:.3f} | {faster} |")
    return "\n".join(lines)


def summarize(res: dict) -> str:
    ranks = res["ranks"]
    steps0 = ranks[0]["steps"]
    modes = list(steps0)
    p = res["world"]
    pred = ranks[0]["predictions"]
    tr = pred["transit"]
    from fsdpx.sharding.schedule_sim import Transfer

    def measured(mode):
        return [s for s in steps0[mode] if not s["warmup"]]

    plain = [m for m in modes if m.startswith("fsdpx-") and not m.endswith("-private")]
    waits = {m: [d for i, s in enumerate(steps0[m]) if not s["warmup"] for d in transit_in_schedule(res, m, i)]
             for m in plain}
    pooled = [d for m in plain for d in waits[m]]
    in_situ = Transfer(latency=statistics.median(pooled)) if pooled else Transfer()

    def ratio(mode, ref):
        """Median of same-round step-time ratios, with their quartiles (the spread a loaded
        machine leaves), and the median ratio of the slowest rank's process CPU time."""
        if ref not in steps0:
            return "-"
        rs = [a["seconds"] / b["seconds"] for a, b in zip(measured(mode), measured(ref))]
        cpu = statistics.median(a["cpu"] / b["cpu"] for a, b in zip(measured(mode), measured(ref)))
        med, q1, q3, lo, hi, faster = ratio_summary(rs)
        return f"{med:.3f}x [{q1:.2f}-{q3:.2f}] 95% {lo:.3f}-{hi:.3f}, faster {faster}/{len(rs)}, cpu {cpu:.2f}x"

    lines = [f"### {p} processes (Mesh(dp=1, pp={p})), GPT {res['config']}, global batch {GLOBAL_BATCH}, "
             f"{MICROBATCHES} microbatches, fp32, 1 thread per process", "",
             f"Transit on the gloo group (one-way, median over every neighbouring pair, {PING_REPS} round trips "
             f"each, before and after the rounds): "
             f"1 element {tr['latency_s'] * 1e3:.3f} ms, one activation ({tr['activation_bytes']} bytes) "
             f"{tr['activation_s'] * 1e3:.3f} ms; in the schedule (sender's transfer group start to the "
             f"waiting receiver's end, median of {len(pooled)} messages, every plain fsdpx mode): "
             f"{in_situ.delay * 1e3:.3f} ms", "",
             "| mode | step s | vs torch, same schedule | vs fsdpx-1f1b | measured bubble (of it, in transfers waiting "
             "for a core) | simulated bubble "
             "(median F/B/W): transfers free / + ping-pong transit / + each rank's CPU per transfer / the same with "
             f"each action's CPU on the host's {pred.get('cores', '?')} shared cores | the third with the measured "
             "spread: each F, B, W drawn from its stage's durations, mean [quartiles] of 200 draws; measured vs it "
             "(vs the medians' third) | replay of each "
             "step's own F/B/W: transfers free / + its transfer groups' CPU and in-schedule transit | "
             "loss (last round) |",
             "|---|---|---|---|---|---|---|---|---|"]
    diag = ["", "Per rank, median ms per step: schedule loop / inside F, B, W / inside transfers (wall, "
            "thread CPU, waiting for a core) / the rest of the loop (private: W's formed while waiting count in F, B, W and in "
            "transfers: left out of the latter; torch: its transfers untimed, the rest is transfers and waits); "
            "on the common clock: the loops' start spread, makespan measured / "
            "replayed (transfers free; with their CPU and transit), the mode's own in-schedule transit (median, "
            "quartiles)", "",
            "| mode | " + " | ".join(f"rank {r}" for r in range(p)) + " | start spread ms | makespan ms | transit ms |",
            "|---|" + "---|" * (p + 3)]
    for mode in modes:
        ms = measured(mode)
        sec = statistics.median(s["seconds"] for s in ms)
        kind = mode.split("-", 1)[1].removesuffix("-private")
        torch_ref = f"torch-{kind}" if mode.startswith("fsdpx-") and not mode.endswith("-private") else None
        sim = again = spread_cell = "-"
        # over the schedule loop only (the update and the step's bookkeeping are no bubble): the
        # loops start together after the step's first barrier-free work, so the longest loop is
        # the schedule's makespan. torch's: its stages' F/B/W and loss timed the same way
        b = [sum(max(s["schedule"]) - c for c in s["computes"]) / (p * max(s["schedule"])) for s in ms]
        bubble = f"{statistics.median(b):.3f}"
        if mode.startswith("fsdpx-") and "transfer_core_wait" in ms[0]:
            # of it, the ranks' time in transfers waiting for a core, not for a message
            core = [sum(s["transfer_core_wait"]) / (p * max(s["schedule"])) for s in ms]
            bubble += f" (core {statistics.median(core):.3f})"

        def med(f):
            return statistics.median(f(s) for s in ms) * 1e3
        fsdpx = mode.startswith("fsdpx-")
        cells = []
        for r in range(p):
            loop, comp = med(lambda s: s["schedule"][r]), med(lambda s: s["computes"][r])
            if fsdpx:
                tw, tc = med(lambda s: s["transfer"][r]), med(lambda s: s["transfer_cpu"][r])
                td = med(lambda s: s.get("transfer_core_wait", [0.0] * p)[r])
                rest = med(lambda s: s["schedule"][r] - s["computes"][r] - s["transfer"][r])
                cells.append(f"{loop:.0f} / {comp:.0f} / {tw:.0f} ({tc:.1f}, {td:.1f}) / {rest:.1f}")
            else:  # torch's transfers are not timed: the rest of its loop is transfers and waits
                cells.append(f"{loop:.0f} / {comp:.0f} / - / {loop - comp:.1f}")
        clock = "- | - | -"
        if fsdpx:
            sim = " / ".join(f"{pred[mode][k]:.3f}" for k in ("bubble", "bubble_transit", "bubble_occupied"))
            sim += f" / {pred[mode]['bubble_cores']:.3f}" if "bubble_cores" in pred[mode] else " / -"
            spread = spread_prediction(res, mode)
            measured_b = statistics.median(b)
            spread_cell = (f"{spread.mean:.3f} [{spread.quartiles[0]:.3f}-{spread.quartiles[2]:.3f}]; "
                           f"{(measured_b / spread.mean - 1) * 100:+.1f}% "
                           f"({(measured_b / pred[mode]['bubble_occupied'] - 1) * 100:+.1f}%)")
            plays = [replay(res, mode, i, in_situ) for i, s in enumerate(steps0[mode]) if not s["warmup"]]
            # a step agrees with its replay when its measured bubble is within 10% of the replay's
            near = sum(abs(r["bubble"] - r["replay_transit_bubble"]) <= 0.1 * r["replay_transit_bubble"]
                       for r in plays)
            again = (f"{statistics.median(r['replay_bubble'] for r in plays):.3f} / "
                     f"{statistics.median(r['replay_transit_bubble'] for r in plays):.3f} "
                     f"({near}/{len(plays)} steps within 10%)") if plays else "-"
            if plays:
                clock = (f"{statistics.median(r['skew'] for r in plays) * 1e3:.1f} | "
                         f"{statistics.median(r['makespan'] for r in plays) * 1e3:.0f} / "
                         f"{statistics.median(r['replay_makespan'] for r in plays) * 1e3:.0f}, "
                         f"{statistics.median(r['replay_transit_makespan'] for r in plays) * 1e3:.0f}")
                if len(waits.get(mode, [])) > 1:  # a private group's end includes the W's it formed
                    q = statistics.quantiles(waits[mode], n=4)
                    clock += f" | {statistics.median(waits[mode]) * 1e3:.2f} [{q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}]"
                else:
                    clock += " | -"
        diag.append(f"| {mode} | " + " | ".join(cells) + f" | {clock} |")
        loss = ranks[-1]["steps"][mode][-1]["loss"]  # torch reports it on the last stage's rank
        lines.append(f"| {mode} | {sec:.3f} | {ratio(mode, torch_ref) if torch_ref else '-'} | "
                     f"{ratio(mode, 'fsdpx-1f1b')} | {bubble} | {sim} | {spread_cell} | {again} | {loss:.5f} |")
    return "\n".join(lines + diag + per_stage_table(res, modes))


def per_stage_table(res: dict, modes: list[str]) -> list[str]:
    """Median ms of one action per stage (F, B, W; torch's schedule-computed loss added to its
    F, as fsdpx's last stage computes it in F) and the step's time outside the schedule loop (the
    update and bookkeeping), fsdpx beside torch for each schedule both ran."""
    out = ["", "Per stage, median ms of one action, fsdpx / torch (torch's F includes its loss); "
           "outside the loop: the step minus the loop, per rank", "",
           "| schedule | stage | F | B | W | outside the loop (rank of the stage) |", "|---|---|---|---|---|---|"]
    p = res["world"]
    for mode in modes:
        kind = mode.split("-", 1)[1]
        if not mode.startswith("fsdpx-") or f"torch-{kind}" not in modes:
            continue
        pair = (mode, f"torch-{kind}")
        stages = sorted({int(k[1:]) for r in res["ranks"] for k in r["steps"][mode][-1]["action_means"]})
        for st in stages:
            rank = st % p
            steps = {m: [s for s in res["ranks"][rank]["steps"][m] if not s["warmup"]] for m in pair}

            def med(m, key):
                vals = [s["action_means"].get(key, 0.0) for s in steps[m]]
                return statistics.median(vals) * 1e3

            def cell(key):
                a = med(mode, key[0] + str(st))
                b = sum(med(pair[1], k + str(st)) for k in key)
                return f"{a:.1f} / {b:.1f}"
            outside = " / ".join(f"{statistics.median(s['walls'][rank] - s['schedule'][rank] for s in steps[m]) * 1e3:.1f}"
                                 for m in pair)
            out.append(f"| {kind} | {st} | {cell('FL')} | {cell('B')} | {cell('W')} | {outside} |")
    return out


def summarize_memory(res: dict) -> str:
    p = res["world"]
    mib = 1 << 20
    lines = [f"### Peak memory over the schedule, {p} processes (MiB above the loop's start, per rank 0..{p - 1}; "
             f"MALLOC_MMAP_THRESHOLD_=65536, largest of the memory rounds)", "",
             "| mode | peak in flight per rank (simulator) | measured | predicted: held activations (private: and "
             "contributions) + gradients | of which held | one microbatch keeps, per stage |", "|---|---|---|---|---|---|"]
    for mode, pred in res["predictions"].items():
        measured = [max(r["memory"]["peaks"][mode]) / mib for r in res["ranks"]]
        predicted = " / ".join(f"{(a + g) / mib:.1f}" for a, g in zip(pred["activations"], pred["grads"]))
        act = " / ".join(f"{a / mib:.1f}" for a in pred["activations"])
        kept = " / ".join(f"{b / mib:.1f}" for b in pred["kept_per_stage"])
        if "contributions_per_stage" in pred:  # private: activations until B, contributions until W
            kept += " (contributions " + " / ".join(f"{b / mib:.1f}" for b in pred["contributions_per_stage"]) + ")"
        lines.append(f"| {mode} | {' / '.join(map(str, pred['in_flight']))} | "
                     f"{' / '.join(f'{m:.1f}' for m in measured)} | {predicted} | {act} | {kept} |")
    return "\n".join(lines)


def driver(args) -> None:
    from bench_common import launch_worker

    t0 = time.perf_counter()
    common = ["--worker", "--warmup", str(args.warmup), "--modes", args.modes, *(["--small"] if args.small else [])]
    out: dict[str, Any] = {}
    texts = []
    cores = len(os.sched_getaffinity(0))
    if args.nproc > cores:
        log(f"note: {args.nproc} processes share {cores} cores; a rank can wait for a core inside a transfer "
            "(the 'waiting for a core' share), which no core-per-rank simulation predicts: judge the bubble "
            "where every process has a core")
    if args.sched == "batch":  # inherited by torchrun and every worker
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        log("SCHED_BATCH: a rank woken by a message waits for a core to come free (or a tick) instead of "
            "preempting the rank that sent it")
    if args.rounds:
        load = os.getloadavg()[0]
        log(f"timing job: {args.nproc} processes, {args.rounds} rounds; load average {load:.1f}")
        res = launch_worker(os.path.abspath(__file__), [*common, "--job", "timing", "--rounds", str(args.rounds)],
                            KEEP_ENV if args.malloc == "keep" else {}, args.nproc, log)
        texts.append(summarize(res))
        out["timing"] = {**res, "load": [load, os.getloadavg()[0]], "table": texts[-1], "malloc": args.malloc,
                         "sched": args.sched}
        log(f"timing job done; load average {os.getloadavg()[0]:.1f}")
    if args.mem_rounds:
        log(f"memory job: {args.nproc} processes, {args.mem_rounds} rounds")
        res = launch_worker(os.path.abspath(__file__),
                            [*common, "--job", "memory", "--mem-rounds", str(args.mem_rounds)], MALLOC_ENV,
                            args.nproc, log)
        texts.append(summarize_memory(res))
        out["memory"] = {**res, "table": texts[-1]}
    print("\n\n".join(texts))
    log(f"done in {time.perf_counter() - t0:.0f}s; load average {os.getloadavg()[0]:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mem-rounds", type=int, default=2, help="rounds of the memory job (0: none)")
    ap.add_argument("--job", choices=("timing", "memory"), default="timing", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join([*(f"fsdpx-{k}" for k in KINDS), "fsdpx-1f1b-private",
                                                 *(f"torch-{k}" for k in TORCH_KINDS)]))
    ap.add_argument("--out", default=None)
    ap.add_argument("--malloc", choices=("default", "keep"), default="default",
                    help="timing job's glibc malloc: its defaults, or keep freed memory (no page faults on reuse)")
    ap.add_argument("--sched", choices=("default", "batch"), default="default",
                    help="the processes' CPU scheduling policy: the kernel's default, or SCHED_BATCH (no wakeup "
                         "preemption: where processes outnumber cores, a send no longer hands the sender's core to "
                         "the rank it wakes)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--paired", nargs="+", metavar="JSON", default=None,
                    help="print the fsdpx / torch ratios pooled over these --out files, run nothing")
    ap.add_argument("--tables", nargs="+", metavar="JSON", default=None,
                    help="print the timing tables of these --out files again, with this version's columns, run nothing")
    args = ap.parse_args()
    if args.paired:
        print(paired(args.paired))
        return
    if args.tables:
        for path in args.tables:
            with open(path) as f:
                print(f"{path}\n\n{summarize(json.load(f)['timing'])}\n")
        return
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
