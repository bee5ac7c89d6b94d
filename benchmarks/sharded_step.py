"""One sharded train step on 2 gloo processes: fsdpx zero3 (plain and private) vs FSDP2 vs DDP.

    .venv/bin/python benchmarks/sharded_step.py [--small] [--out results.json]

Run plainly, this file is the driver: it launches itself under torchrun (2 processes, 1 thread
each) once for the timing job, then once per (mode, malloc setting) for the memory jobs, and
prints markdown tables. Progress goes to stderr.

Every mode trains the SAME model (one ``fsdpx.models.gpt.GPT``, ~49M fp32 parameters, LM head
tied to the token embedding, built from one seed), on the SAME global batch (each rank takes its
``torch.chunk`` half), with AdamW of the same hyper-parameters:

* ``fsdpx-zero3``          ``make_sharded_step(..., strategies.zero3(), donate=True)``, ``fsdpx.optim.adamw``
                           (donated state: AdamW writes in place, as ``torch.optim`` does; the
                           main job runs this way too)
* ``fsdpx-zero3-private``  the same with ``DPConfig(method="ghost", clip 1, noise 1)``
* ``fsdp2``                ``fully_shard`` on every block, then on the root (both with
                           ``reshard_after_forward=True``), ``torch.optim.AdamW``
* ``ddp``                  ``DistributedDataParallel``, ``torch.optim.AdamW``
* ``fsdpx-ddp``            ``make_sharded_step(..., strategies.ddp(), donate=True)``

Timing job: all modes live in one pair of processes; for each round, for each mode (the order
rotates every round): barrier, time one step on each rank. A step's time is the slower rank's;
the table gives the median over the measured rounds (after the warm-up rounds).

Bytes: counting wrappers around the ``torch.distributed`` functions the runtimes call
(``all_gather_into_tensor`` / ``all_gather_single``: output buffer; ``reduce_scatter_tensor`` /
``reduce_scatter_single``: input buffer; ``all_reduce``: the buffer), active only inside a timed
step. FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``; DDP's reducer
calls C++ directly, so DDP runs with the Python ``allreduce_hook`` (the same arithmetic as the
built-in hook: divide by world size, all-reduce the bucket), whose ``dist.all_reduce`` is counted.
For fsdpx the step's own ``metrics["comm_bytes"]`` is reported too (it must agree), next to the
algebra's ``fsdpx.comm_per_step``.

Phases (median seconds per step, slower rank): ``gather`` and ``reduce`` are the time inside the
counted collectives (fsdpx: inside ``DistComm.run``, i.e. with its padding/concatenation copies;
the torch-level time alone is in the JSON), ``noise`` is fsdpx's ``shard_noise``, ``update`` the
optimizer, ``compute`` everything else (forward, backward, ghost clipping, FSDP2's copy-in/out).

Memory job: one mode per torchrun invocation. ``VmRSS`` right after the full model is built is
the baseline; ``VmHWM`` is reset there (``/proc/self/clear_refs`` = 5), the mode is set up and
runs ``--mem-steps`` steps, and the peak above the baseline is reported, once with glibc's
defaults and once with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps freed heap memory
resident, which hides what a runtime frees). fsdpx keeps the module only as a skeleton, so the
benchmark releases its full parameters (storage resized to 0) after ``init_sharded``; FSDP2's
``fully_shard`` drops them itself.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Counter, MemMarks, clocks, launch_worker, logger, nbytes as _nbytes,  # noqa: E402
                          paired_ratio, per_rank_cell, random_token_batch, reset_hwm, seeded_gpt, status_kb,
                          write_report)

MODES = ["fsdpx-zero3", "fsdpx-zero3-private", "fsdp2", "ddp", "fsdpx-ddp"]
LR, WD = 1e-3, 0.01
CLIP, SIGMA = 1.0, 1.0
MB = 1e6

# ~49M parameters: the cost model's FSDP2 anchor (tests/test_cost_model.py: 48,912,896 params,
# width 512, 10 blocks, no biases); our GPT adds a 128 x 512 position table, so the vocabulary is
# 128 rows smaller to land on exactly the same count. Every dim 0 is even: no padding on 2 ranks.
FULL = dict(vocab_size=33944, block_size=128, n_layer=10, n_head=8, n_embd=512, bias=False, tie_weights=True)
SMALL = dict(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64, bias=False, tie_weights=True)
GLOBAL_BATCH = 8
DEVICE = "cpu"  # the worker's device: "cpu" (gloo) or "cuda:LOCAL_RANK" (NCCL), set from --device


log = logger("sharded_step")


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

COUNT = Counter()


def install_counting_wrappers() -> None:
    """Wrap the ``torch.distributed`` functions fsdpx, FSDP2 and DDP's comm hook call; the
    runtimes look them up on the module at call time, so the wrappers see every call."""
    import torch.distributed as dist

    def arg(i: int, name: str):
        return lambda args, kwargs: args[i] if len(args) > i else kwargs[name]

    table = {
        "all_gather_into_tensor": ("all_gather", arg(0, "output_tensor")),
        "all_gather_single": ("all_gather", arg(0, "output_tensor")),
        "reduce_scatter_tensor": ("reduce_scatter", arg(1, "input")),
        "reduce_scatter_single": ("reduce_scatter", arg(1, "input")),
        "all_reduce": ("all_reduce", arg(0, "tensor")),
        "all_gather_object": ("object", None),
        "broadcast": ("broadcast", arg(0, "tensor")),
        "all_to_all": ("all_to_all", None),
    }
    for fn_name, (kind, pick) in table.items():
        real = getattr(dist, fn_name, None)
        if real is None:
            continue

        def counted(*args, _real=real, _kind=kind, _pick=pick, **kwargs):
            if not COUNT.active:
                return _real(*args, **kwargs)
            nbytes = _nbytes(_pick(args, kwargs)) if _pick else 0
            t0 = clocks()
            out = _real(*args, **kwargs)
            COUNT.add(_kind, nbytes, t0)
            return out

        setattr(dist, fn_name, functools.wraps(real)(counted))


MEM = MemMarks()
timed = functools.partial(COUNT.timed, marks=MEM)  # fn timed as a phase of COUNT, marking MEM


def install_fsdpx_timers(comm) -> None:
    """Phase timers around fsdpx's collectives (``DistComm.run`` on this instance), its noise
    draw and its metric gathers: module-level names looked up at call time, patched in this
    process only (fsdpx's files are untouched)."""
    import fsdpx.runtime.owned_noise as noise_mod  # the module whose globals OwnedNoise.pop looks up
    import fsdpx.runtime.step as rt  # the module whose globals the step looks up

    real_run = comm.run

    def run(c, x):
        t0 = clocks()
        out = real_run(c, x)
        if COUNT.active:
            kind = {"all_gather": "gather", "reduce_scatter": "reduce", "all_reduce": "reduce"}.get(c.kind, "local")
            COUNT.phase(kind, t0)
        return out

    comm.run = run
    comm.all_gather_object = timed("metrics", comm.all_gather_object)
    noise_mod.shard_noise = timed("noise", noise_mod.shard_noise)
    # the step calls reduce_and_update once the backward is over: a memory mark only
    rt.reduce_and_update = timed("reduce_and_update", rt.reduce_and_update, before="forward+backward")


def local_half(batch, rank: int, world: int):
    import torch

    x, y = batch
    return torch.chunk(x, world)[rank], torch.chunk(y, world)[rank]


def dp_config():
    from privacy.step import DPConfig

    # expected batch q*N = GLOBAL_BATCH, so private and plain steps divide by the same number
    return DPConfig(clip_norm=CLIP, noise_multiplier=SIGMA, sample_rate=GLOBAL_BATCH / 8000, method="ghost")


def build_fsdpx(model, comm, strategy_name: str, private: bool):
    """A ``run(batch) -> (loss, metrics)`` for an fsdpx strategy; consumes ``model`` (its own
    full parameters are released: the step reads only the sharded state)."""
    from fsdpx import init_sharded, make_sharded_step, strategies
    from fsdpx.models.gpt import token_loss
    from fsdpx.optim import Optimizer, adamw

    opt = adamw(LR, weight_decay=WD)
    opt = Optimizer(opt.init, timed("update", opt.update, before="reduce", after="update"),
                    timed("update", opt.update_inplace, before="reduce", after="update"))
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    strategy = strategies.ALL[strategy_name]()
    config = dp_config() if private else None
    step = make_sharded_step(model, token_loss, opt, strategy, comm, param_shapes=shapes, config=config,
                             num_examples=8000 if private else None, donate=True)
    holder = [init_sharded(params, opt, strategy, comm, key=0, config=config)]
    del params
    for p in model.parameters():
        p.untyped_storage().resize_(0)

    def run(batch):
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"], metrics

    return run


def build_fsdp2(model, rank: int, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdpx.models.gpt import token_loss

    mesh = init_device_mesh(DEVICE.split(":")[0], (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    # explicit True: left at None, FSDP2 keeps the root unsharded between forward and backward
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    opt.step = timed("update", opt.step, before="forward+backward", after="update")
    return _torch_run(model, opt, token_loss, rank, world)


def build_ddp(model, rank: int, world: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from fsdpx.models.gpt import token_loss

    cuda = DEVICE.startswith("cuda")
    ddp = DistributedDataParallel(model, device_ids=[torch.device(DEVICE).index] if cuda else None)
    ddp.register_comm_hook(dist.group.WORLD, allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
    opt.step = timed("update", opt.step, before="forward+backward", after="update")
    return _torch_run(ddp, opt, token_loss, rank, world)


def _torch_run(model, opt, loss_fn, rank: int, world: int):
    def run(batch):
        x, y = local_half(batch, rank, world)
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach()) / world, {}  # the caller sums over ranks: the global mean

    return run


def build(mode: str, model, comm, rank: int, world: int):
    if mode == "fsdpx-zero3":
        return build_fsdpx(model, comm, "zero3", private=False)
    if mode == "fsdpx-zero3-private":
        return build_fsdpx(model, comm, "zero3", private=True)
    if mode == "fsdpx-ddp":
        return build_fsdpx(model, comm, "ddp", private=False)
    if mode == "fsdp2":
        return build_fsdp2(model, rank, world)
    if mode == "ddp":
        return build_ddp(model, rank, world)
    raise ValueError(f"unknown mode {mode!r}; known: {MODES}")


def timed_step(run, batch) -> dict[str, Any]:
    import torch.distributed as dist

    import torch

    cuda = DEVICE.startswith("cuda")
    dist.barrier()
    if cuda:  # a step's GPU time counts in full, and its transient peak above what lives between steps
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    COUNT.reset()
    COUNT.active = True
    MEM.mark("between steps")
    t0, c0 = time.perf_counter(), time.process_time()
    loss, metrics = run(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    MEM.mark("end of step")
    COUNT.active = False
    rec = {"seconds": seconds, "cpu_seconds": cpu, "loss": float(loss), **COUNT.record(),
           "fsdpx_comm": metrics.get("comm_bytes"), "resident_bytes": metrics.get("resident_bytes")}
    if cuda:
        rec["cuda_step_peak_bytes"] = torch.cuda.max_memory_allocated() - allocated
    return rec


def predictions(cfg: dict, mesh) -> dict[str, Any]:
    """The algebra's bytes per rank per step and resident state per rank, from shapes only."""
    import torch

    from fsdpx import comm_per_step, memory_by_rank, strategies
    from fsdpx.runtime.units import make_units

    with torch.device("meta"):
        model = seeded_gpt(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    units = [list(u.params) for u in make_units(model, shapes)]
    out = {"params": sum(torch.Size(s).numel() for s in shapes.values()), "units": len(units)}
    for name in ("zero3", "ddp"):
        s = strategies.ALL[name]()
        out[name] = {"comm": comm_per_step(s, shapes, mesh, units),
                     "memory_by_rank": memory_by_rank(s, shapes, mesh, "adamw")}
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    # first, before fsdpx is imported: a module may bind a collective to a name at import time
    install_counting_wrappers()

    # every runtime's modules are imported before any memory baseline is taken
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import fsdpx.runtime  # noqa: F401
    import privacy.step  # noqa: F401
    from fsdpx import Mesh
    from fsdpx.runtime.dist_comm import init_from_env

    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (older fsdpx called them)
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated. Please use")
    global DEVICE
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        DEVICE = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    comm = init_from_env(Mesh(dp=world), device=DEVICE, timeout_s=1800.0)
    rank = comm.rank
    install_fsdpx_timers(comm)
    cfg = SMALL if args.small else FULL
    say = log if rank == 0 else (lambda msg: None)
    result: dict[str, Any] = {"rank": rank, "world": world, "threads": torch.get_num_threads(),
                              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}

    if args.worker == "time":
        modes = args.modes.split(",")
        base = seeded_gpt(cfg).to(DEVICE)
        batch = tuple(t.to(DEVICE) for t in random_token_batch(cfg, GLOBAL_BATCH))
        runs = {}
        for mode in modes:
            t0 = time.perf_counter()
            runs[mode] = build(mode, copy.deepcopy(base), comm, rank, world)
            say(f"built {mode} in {time.perf_counter() - t0:.1f}s")
        steps: dict[str, list] = {m: [] for m in modes}
        for i in range(args.warmup + args.steps):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                rec = timed_step(runs[mode], batch)
                rec["warmup"] = i < args.warmup
                steps[mode].append(rec)
                say(f"round {i + 1}/{args.warmup + args.steps} {mode}: {rec['seconds']:.2f}s"
                    f"{' (warm-up)' if rec['warmup'] else ''}  load {os.getloadavg()[0]:.1f}")
        result["steps"] = steps
    else:
        mode = args.mode
        rss_start = status_kb("VmRSS")
        model = seeded_gpt(cfg)
        batch = random_token_batch(cfg, GLOBAL_BATCH)
        rss_model = status_kb("VmRSS")
        hwm_model = status_kb("VmHWM")
        reset = reset_hwm()
        MEM.active = reset
        run = build(mode, model, comm, rank, world)
        del model
        MEM.mark("set-up")
        recs = []
        for _ in range(args.mem_steps):
            MEM.peaks = {k: v for k, v in MEM.peaks.items() if k == "set-up"}  # keep the last step's phases
            recs.append(timed_step(run, batch))
        MEM.active = False
        result.update(mode=mode, hwm_reset=reset, rss_start_kb=rss_start, rss_model_kb=rss_model,
                      hwm_model_kb=hwm_model, phase_peaks_kb=dict(MEM.peaks),
                      hwm_kb=MEM.overall if reset else status_kb("VmHWM"), rss_end_kb=status_kb("VmRSS"),
                      resident_bytes=recs[-1]["resident_bytes"], step_seconds=[r["seconds"] for r in recs])

    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        out = {"config": cfg, "ranks": everyone, "load": os.getloadavg()}
        if args.worker == "time":
            out["prediction"] = predictions(cfg, comm.mesh)
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------

def launch(worker_args: list[str], env_extra: dict[str, str], nproc: int) -> dict:
    return launch_worker(os.path.abspath(__file__), worker_args, env_extra, nproc, log)


def summarize_time(job: dict) -> dict[str, Any]:
    """Per mode: median step (slower rank), bytes/calls per kind per rank (checked equal across
    measured steps), fsdpx's own count, median phases, losses (sum over ranks: global mean)."""
    ranks = job["ranks"]
    out = {}
    for mode in ranks[0]["steps"]:
        per_rank = [[s for s in r["steps"][mode] if not s["warmup"]] for r in ranks]
        n = len(per_rank[0])
        slow = [max(pr[i]["seconds"] for pr in per_rank) for i in range(n)]
        cpu = [max(pr[i]["cpu_seconds"] for pr in per_rank) for i in range(n)]
        slowest = [max((pr[i] for pr in per_rank), key=lambda r: r["seconds"]) for i in range(n)]
        parts = [breakdown(r) for r in slowest]
        phase_med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        busiest = [max((pr[i] for pr in per_rank), key=lambda r: r["cpu_seconds"]) for i in range(n)]
        parts_cpu = [breakdown(r, cpu=True) for r in busiest]
        phase_cpu_med = {k: statistics.median(p[k] for p in parts_cpu) for k in parts_cpu[0]}
        bytes_stable = all(s["bytes"] == pr[0]["bytes"] and s["calls"] == pr[0]["calls"] for pr in per_rank for s in pr)
        all_steps = [r["steps"][mode] for r in ranks]
        if mode.startswith("fsdpx"):  # fsdpx reports the global mean on every rank
            losses = [s["loss"] for s in all_steps[0]]
        else:  # each rank returned its local mean / world
            losses = [sum(ar[i]["loss"] for ar in all_steps) for i in range(len(all_steps[0]))]
        out[mode] = {
            "median_s": statistics.median(slow), "steps_s": slow,
            "median_cpu_s": statistics.median(cpu), "steps_cpu_s": cpu,
            "bytes_per_rank": [pr[-1]["bytes"] for pr in per_rank],
            "calls_per_rank": [pr[-1]["calls"] for pr in per_rank],
            "bytes_stable_across_steps": bytes_stable,
            "fsdpx_comm_per_rank": [pr[-1]["fsdpx_comm"] for pr in per_rank],
            "phases_median_s": phase_med, "phases_median_cpu_s": phase_cpu_med,
            "losses": losses,
            "cuda_step_peak_bytes": [pr[-1].get("cuda_step_peak_bytes") for pr in per_rank],
        }
    return out


PHASES = ["all_gather", "reduce", "comm_copies", "noise", "update", "metrics", "compute"]


def breakdown(rec: dict, cpu: bool = False) -> dict[str, float]:
    """One rank's step split into phases: time inside the counted torch.distributed calls,
    fsdpx's own work around them in ``DistComm.run`` (padding, concatenation, local slices),
    noise, optimizer, metric gathers, and the rest (forward, backward, clipping, FSDP2 copies)."""
    cs, ph = (rec["coll_cpu"], rec["phases_cpu"]) if cpu else (rec["coll_seconds"], rec["phases"])
    out = {"all_gather": cs.get("all_gather", 0.0),
           "reduce": cs.get("reduce_scatter", 0.0) + cs.get("all_reduce", 0.0)}
    in_comm = ph.get("gather", 0.0) + ph.get("reduce", 0.0) + ph.get("local", 0.0)
    out["comm_copies"] = max(in_comm - out["all_gather"] - out["reduce"], 0.0) if in_comm else 0.0
    out.update(noise=ph.get("noise", 0.0), update=ph.get("update", 0.0), metrics=ph.get("metrics", 0.0))
    out["compute"] = rec["cpu_seconds" if cpu else "seconds"] - sum(out.values())
    return out


def fmt_mb(b) -> str:
    return "-" if not b else f"{b / MB:.1f}"


def tables(res: dict) -> str:
    lines: list[str] = []
    pred = res.get("prediction")
    t = res.get("time")
    if t:
        lines += ["Step time per mode: wall clock and process CPU time (all threads, gloo's included) of the "
                  "slower rank, median over the measured rounds; ratios are medians of same-round ratios:", "",
                  "| mode | wall s | wall vs FSDP2 | wall vs fsdpx-zero3 | CPU s | CPU vs FSDP2 | CPU vs fsdpx-zero3 |",
                  "|---|---|---|---|---|---|---|"]
        for mode, m in t.items():
            w, c = m["median_s"], m["median_cpu_s"]
            lines.append(f"| {mode} | {w:.2f} | {paired_ratio(t, mode, 'fsdp2', 'steps_s')} "
                         f"| {paired_ratio(t, mode, 'fsdpx-zero3', 'steps_s')} | {c:.2f} "
                         f"| {paired_ratio(t, mode, 'fsdp2', 'steps_cpu_s')} "
                         f"| {paired_ratio(t, mode, 'fsdpx-zero3', 'steps_cpu_s')} |")
        if res.get("device") == "cuda":
            lines += ["", "GPU memory of a step above what lives between steps (max_memory_allocated, MB, "
                      "rank 0's last measured step):", "", "| mode | step peak MB |", "|---|---|"]
            lines += [f"| {mode} | {fmt_mb(m['cuda_step_peak_bytes'][0])} |" for mode, m in t.items()]
        lines += ["", "Bytes per collective kind per rank per step, counted at the torch.distributed call "
                  "(MB = 1e6 B; one number when both ranks agree, else rank 0 / rank 1), and the algebra's "
                  "`fsdpx.comm_per_step`:", "",
                  "| mode | all-gather MB | reduce-scatter MB | all-reduce MB | calls AG/RS/AR | fsdpx's own count agrees |",
                  "|---|---|---|---|---|---|"]
        for mode, m in t.items():
            b, c, own = m["bytes_per_rank"], m["calls_per_rank"][0], m["fsdpx_comm_per_rank"]
            agree = "-"
            if own[0] is not None:
                agree = "yes" if all(o.get(k, 0) == bb.get(k, 0) for o, bb in zip(own, b)
                                     for k in ("all_gather", "reduce_scatter", "all_reduce")) else "NO"
            lines.append(f"| {mode} | {per_rank_cell([x.get('all_gather') for x in b], fmt_mb)} "
                         f"| {per_rank_cell([x.get('reduce_scatter') for x in b], fmt_mb)} "
                         f"| {per_rank_cell([x.get('all_reduce') for x in b], fmt_mb)} "
                         f"| {c.get('all_gather', 0)}/{c.get('reduce_scatter', 0)}/{c.get('all_reduce', 0)} | {agree} |")
        if pred:
            for name in ("zero3", "ddp"):
                p = pred[name]["comm"]
                lines.append(f"| algebra `comm_per_step({name})` | {fmt_mb(p.get('all_gather'))} "
                             f"| {fmt_mb(p.get('reduce_scatter'))} | {fmt_mb(p.get('all_reduce'))} | | |")
        for clock, key, total in (("CPU", "phases_median_cpu_s", "median_cpu_s"), ("wall", "phases_median_s", "median_s")):
            lines += ["", f"Phases, {clock} seconds per step (rank with the larger {clock} time of each round, "
                      "median per column, so a row need not add up exactly; collectives: time inside the "
                      "torch.distributed call; DDP's all-reduce is asynchronous, its column is the launch only):", "",
                      "| mode | step | all-gather | reduce-scatter / all-reduce | fsdpx copies around collectives "
                      "| noise | update | metrics gather | compute + rest |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for mode, m in t.items():
                ph = m[key]
                cells = " | ".join(f"{ph[k]:.2f}" for k in PHASES)
                lines.append(f"| {mode} | {m[total]:.2f} | {cells} |")
        plain = [m for m in t if m != "fsdpx-zero3-private"]
        if plain:
            ref_losses = t[plain[0]]["losses"]
            worst = max(abs(a - b) / abs(b) for m in plain for a, b in zip(t[m]["losses"], ref_losses))
            lines += ["", f"Same model, batch and optimizer: the losses of every step of {', '.join(plain)} "
                          f"agree to a relative {worst:.1e}."]
        lines.append("")
    mem = res.get("memory")
    if mem:
        def mb(kb: int) -> str:
            return f"{kb * 1024 / MB:.0f}"

        def above(job, key="hwm_kb") -> str:
            return " / ".join(mb(r[key] - r["rss_model_kb"]) for r in job["ranks"]) if job else "-"

        lines += ["Peak resident memory per rank over set-up + steps, above VmRSS right after the full model "
                  "was built (MB; rank 0 / rank 1), next to the resident state the algebra predicts "
                  "(`memory_by_rank`: params + reduced grads + 2 AdamW moments):", "",
                  "| mode | predicted state | fsdpx resident_bytes | peak above model, glibc default "
                  "| peak above model, MALLOC_MMAP_THRESHOLD_=65536 | VmRSS after model (default) |",
                  "|---|---|---|---|---|---|"]
        mem = {mode: by_env for mode, by_env in mem.items() if by_env}  # failed jobs left out
        for mode, by_env in mem.items():
            strategy = "ddp" if mode in ("ddp", "fsdpx-ddp") else "zero3"
            p = pred[strategy]["memory_by_rank"] if pred else None
            d, th = by_env.get("default"), by_env.get("threshold")
            rb = [r["resident_bytes"] for r in (d or th)["ranks"]]
            base = " / ".join(mb(r["rss_model_kb"]) for r in d["ranks"]) if d else "-"
            lines.append(f"| {mode} | {per_rank_cell(p, fmt_mb) if p else '-'} | "
                         f"{per_rank_cell(rb, fmt_mb) if rb[0] is not None else '-'} | {above(d)} | {above(th)} | {base} |")
        phases = ["set-up", "forward+backward", "reduce", "update", "end of step"]
        lines += ["", "Where the peak is (MALLOC_MMAP_THRESHOLD_=65536, rank 0, last step; MB above VmRSS after "
                  "the model; fsdpx reduces after the backward, FSDP2 and DDP during it):", "",
                  "| mode | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
        for mode, by_env in mem.items():
            job = by_env.get("threshold") or by_env.get("default")
            r = job["ranks"][0]
            pk = r.get("phase_peaks_kb", {})
            lines.append(f"| {mode} | " + " | ".join(mb(pk[ph] - r["rss_model_kb"]) if ph in pk else "-"
                                                   for ph in phases) + " |")
        lines.append("")
    return "\n".join(lines)


def driver(args) -> None:
    modes = args.modes.split(",")
    size = ["--small"] if args.small else []
    size += ["--device", args.device]
    if args.device == "cuda" and not args.skip_memory:
        log("--device cuda: the memory jobs measure host RSS, so they are skipped; each timed step "
            "records its GPU peak above what lives between steps (cuda_step_peak_bytes)")
        args.skip_memory = True
    res: dict[str, Any] = {"argv": sys.argv, "device": args.device, "load_start": os.getloadavg(), "cpus": os.cpu_count()}
    t_start = time.perf_counter()
    if not args.skip_time:
        log(f"timing job: {modes}, {args.warmup} warm-up + {args.steps} measured rounds")
        job = launch(["--worker", "time", "--modes", ",".join(modes), "--steps", str(args.steps),
                      "--warmup", str(args.warmup), *size], {}, args.nproc)
        res["config"], res["prediction"] = job["config"], job["prediction"]
        res["time"] = summarize_time(job)
        res["time_raw_ranks"] = job["ranks"]
        res["load_after_time"] = job["load"]
    if not args.skip_memory:
        res["memory"] = {}
        mem_modes = args.mem_modes.split(",")
        for mode in mem_modes:
            res["memory"][mode] = {}
            for label, env in (("default", {}), ("threshold", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
                log(f"memory job: {mode}, malloc {label}")
                try:
                    job = launch(["--worker", "mem", "--mode", mode, "--mem-steps", str(args.mem_steps), *size],
                                 env, args.nproc)
                except (subprocess.CalledProcessError, OSError, ValueError) as e:
                    log(f"memory job {mode} ({label}) failed: {e}; its row is left out")
                    continue
                res["memory"][mode][label] = job
    res["load_end"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t_start
    text = tables(res)
    print(text)
    log(f"done in {res['wall_s']:.0f}s; load average start {res['load_start'][0]:.1f}, end {res['load_end'][0]:.1f}")
    write_report(args.out, res, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny GPT, for checking the script")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=5, help="measured rounds (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mem-steps", type=int, default=2, help="steps per memory job (AdamW state is lazy in torch)")
    ap.add_argument("--mem-modes", default=",".join(MODES[:4]), help="modes measured for memory, one job each")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: NCCL, one GPU per process (--nproc 1 on a one-GPU machine)")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    ap.add_argument("--worker", choices=["time", "mem"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
