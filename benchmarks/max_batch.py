"""The largest private batch per rank under a fixed memory cap: private DDP vs private ZeRO-3
(issue 14 section 3, the seeds' headline: Opacus reports 2.6x for its FSDP over its DDP).

    .venv/bin/python benchmarks/max_batch.py [--small] [--cap-mib 2560] [--seq 128] [--out r.json]
    .venv/bin/python benchmarks/max_batch.py --untied --modes ddp,zero3,opacus-ghost,opacus-ghost_fsdp

Setting: transformers' ``GPT2LMHeadModel`` built from a local config (12 layers, width 768,
12 heads, vocabulary 50257, tied ``wte``/``lm_head``: GPT-2 small, 124M parameters), unmodified,
trained with DP-SGD (ghost clipping, flat clip 1, noise 1) and fsdpx's AdamW on 4 gloo processes
(torchrun, one thread each), one mode per torchrun launch:

* ``ddp``    ``make_sharded_step(..., strategies.ddp())``
* ``zero3``  ``make_sharded_step(..., strategies.zero3())``
* ``zero3-zenflow``  ZeRO-3 with ZenFlow's selective update (``fsdpx.train.build.make_optimizer``
  with ``offload="zenflow"``). On a CPU the "host" is the same memory as the "device": RSS
  cannot show what ZenFlow moves off a GPU, so this row reports what the process holds.

These three are the default ``--modes``. ``--untied`` runs them on the same GPT-2 with
``tie_word_embeddings=False`` (an ``lm_head`` of its own, 162M parameters), the model the Opacus
modes use; fsdpx handles both. Opacus's modes, chosen with ``--modes`` (the anchor's own
FSDP-over-DDP ratio, measured beside ours on the nearest setting where Opacus runs):

* ``opacus-ghost``       Opacus 1.6, ``PrivacyEngine().make_private(module=DPDDP(model),
  optimizer=torch.optim.AdamW(...), criterion=nn.CrossEntropyLoss(), data_loader=...,
  noise_multiplier=1, max_grad_norm=1, grad_sample_mode="ghost", poisson_sampling=False)``:
  ``GradSampleModuleFastGradientClipping``, ``DistributedDPOptimizerFastGradientClipping`` and
  the ``DPLossFastGradientClipping`` criterion. ``--opacus-ddp torch`` wraps the model in torch's
  ``DistributedDataParallel`` instead of Opacus's ``DPDDP`` (Opacus's own distributed ghost
  tests and its FSDP comparison use ``DPDDP``; both run, and on the smoke config two steps of
  each end with the same parameters).
* ``opacus-ghost_fsdp``  the same with ``opacus.utils.fsdp_utils.FSDP2Wrapper(model)`` (FSDP2
  ``fully_shard`` on its default mesh, CPU + gloo here) and ``grad_sample_mode="ghost_fsdp"``:
  ``GradSampleModuleFastGradientClippingFSDP``, ``FSDPOptimizerFastGradientClipping``.

Each runs on the untied model whatever ``--untied`` says (Opacus's ghost clipping refuses tied
parameters), one private step per probe (forward, ``loss.backward()``, which is Opacus's two
backward passes, ``optimizer.step()``) on exactly ``b`` sequences per rank (a
``DistributedSampler`` over the same global batch; ``poisson_sampling=False`` so the batch does not
vary), with ``position_ids`` given per example (transformers' ``(1, T)`` positions give Opacus a
one-row per-example norm for ``wpe`` and the step fails). Opacus as shipped has no norm sampler
for GPT-2's ``Conv1D`` (85M of the 162M parameters): it takes their per-example gradients with
functorch, then the norms; and ``FSDP2Wrapper`` shards only the modules with a sampler or
without trainable parameters (wte, wpe, LayerNorms, lm_head), leaving the Conv1D weights in the
root unit, which FSDP2 keeps unsharded from the forward to the end of the backward. The table
says so. A mode that fails on this setting is a row with its exception text, not a crash. Every
probe checks that each rank took ``--steps`` optimizer steps on ``b`` sequences, and the table
gives the loss and the step count.

Peak memory per rank, measured the same way for every mode: a warm-up private step of the tiny
config in the same mode first; ``VmRSS`` after it is the baseline; the model is built, the
sharded state cut from it and the module's own parameters released (Opacus: the model wrapped,
its optimizer and loss made by ``make_private``); ``VmHWM`` is then reset
(``/proc/self/clear_refs``) and ``--steps`` real private steps run on a global batch of
``world x b`` sequences. The peak is ``VmHWM - baseline``, the largest
over the ranks, with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps freed heap pages
resident and hides what a runtime frees, docs/performance.md). A probe FITS when that peak is at
most the cap. A watchdog thread polls ``VmRSS`` every 5 ms and ends a probe as soon as one rank
is above the cap (that rank's peak is then above the cap too, so the verdict is the same; it only
saves the rest of a doomed step and keeps 4 oversized processes off a shared machine).

Search (``max_fitting``): doubling from a start (fsdpx: the memory model's largest batch under
the cap; Opacus: the other Opacus mode's result when it ran first, else 1) until a batch does not
fit, then bisection between the last fit and the first miss; every probe is a fresh torchrun
launch. The table's "vs its DDP" is fsdpx rows over fsdpx ``ddp`` and Opacus rows over
``opacus-ghost``, on the same model.

Prediction, beside each measurement of fsdpx's modes ("-" for Opacus's)
(``fsdpx.runtime.step_memory.private_step_peak``): the cost model's resident state
(``memory_by_rank``: parameters, reduced gradients, 2 AdamW moments), the
raw gradient the backward produces in the compute layout, the largest gathered unit
(``peak_gathered_bytes``), and the activations, output gradients and per-example factors of the
ghost-clipping step for ``b`` examples, counted by running that step's tape on ``meta`` tensors
with a live-bytes tracker (no data, no time).

Unless ``--skip-opacus``, Opacus 1.6's ghost clipping is also tried on the tied model (both
``ghost`` and ``ghost_fsdp`` wrap it in ``GradSampleModuleFastGradientClipping`` or its FSDP
subclass); it refuses ("Parameter tying is not supported with Ghost Clipping"), and the
exception is printed under the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import launch_worker, logger, reset_hwm, status_kb, write_report  # noqa: E402

MODES = ["ddp", "zero3", "zero3-zenflow"]  # the default list: fsdpx's own modes
OPACUS_MODES = ["opacus-ghost", "opacus-ghost_fsdp"]  # chosen with --modes; always on the untied model
FULL = dict(vocab_size=50257, n_layer=12, n_embd=768, n_head=12)
SMALL = dict(vocab_size=2048, n_layer=2, n_embd=128, n_head=4)
CLIP, SIGMA, NUM_EXAMPLES = 1.0, 1.0, 100_000
MIB = 2 ** 20
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


log = logger("max_batch")


# ----------------------------------------------------------------------------------------------
# the search (pure)
# ----------------------------------------------------------------------------------------------

def max_fitting(fits: Callable[[int], bool], *, guess: int = 1, limit: int = 1 << 20) -> tuple[int, list[tuple[int, bool]]]:
    """The largest ``b`` in ``[1, limit]`` with ``fits(b)`` (0 if ``fits(1)`` is false), for a
    predicate that is monotone (true up to some ``b*``, false above), and the probes made, in
    order, as ``(b, fitted)``.

    Exponential then binary search, from ``guess`` (clamped to ``[1, limit]``): if ``guess``
    fits, steps of 1, 2, 4, ... upwards until a miss (or ``limit``), else the same steps
    downwards until a fit (or below 1); then bisection between the last fit and the first miss.
    The answer never depends on ``guess``; a good guess (the memory model's) only saves probes:
    ``O(log |b* - guess|)``, each ``b`` probed at most once. Raises ``ValueError`` when
    ``limit < 1`` (``tests/test_max_batch_search.py``)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    probes: list[tuple[int, bool]] = []

    def probe(b: int) -> bool:
        ok = bool(fits(b))
        probes.append((b, ok))
        return ok

    b = min(max(guess, 1), limit)
    if probe(b):
        lo, hi, step = b, None, 1
        while lo < limit:
            b = min(lo + step, limit)
            if not probe(b):
                hi = b
                break
            lo, step = b, 2 * step
        if hi is None:
            return lo, probes
    else:
        lo, hi, step = 0, b, 1
        while hi > 1:
            b = max(hi - step, 1)
            if probe(b):
                lo = b
                break
            hi, step = b, 2 * step
        if lo == 0:
            return 0, probes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

def is_opacus(mode: str) -> bool:
    return mode.startswith("opacus-")


def tied_for(mode: str, untied: bool) -> bool:
    """Whether ``mode`` runs the tied GPT-2: fsdpx's modes unless ``--untied``; Opacus's never
    (its ghost clipping refuses tied parameters)."""
    return not (untied or is_opacus(mode))


def gpt2_config(size: dict, seq: int, tied: bool = True):
    import transformers

    return transformers.GPT2Config(vocab_size=size["vocab_size"], n_positions=seq, n_embd=size["n_embd"],
                                   n_layer=size["n_layer"], n_head=size["n_head"], resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, use_cache=False,
                                   bos_token_id=0, eos_token_id=0)


def build_model(size: dict, seq: int, device: str = "cpu", tied: bool = True):
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(gpt2_config(size, seq, tied))
    # tied as GPT-2 ships, or (--untied, Opacus) an lm_head of its own
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    return model


def lm_loss(out, labels):
    """Per-example mean next-token cross-entropy ``(B,)`` from a ``CausalLMOutput``."""
    import torch.nn.functional as F

    logits, y = out.logits[:, :-1], labels[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return tok.view(y.shape).mean(1)


def dp_config(global_batch: int):
    from privacy.step import DPConfig

    return DPConfig(clip_norm=CLIP, noise_multiplier=SIGMA, sample_rate=global_batch / NUM_EXAMPLES, method="ghost")


def make_optimizer(mode: str, comm):
    from fsdpx.optim import adamw

    if mode != "zero3-zenflow":
        return adamw(1e-4)
    from fsdpx.train import RunConfig
    from fsdpx.train.build import make_optimizer as job_optimizer

    return job_optimizer(RunConfig.of(strategy="zero3", offload="zenflow", lr=1e-4), comm)


class Watchdog:
    """Ends this process (exit code 3, after writing ``path``) as soon as ``VmRSS - baseline``
    passes ``cap_kb``: the probe's peak is then above the cap whatever the rest would do."""

    def __init__(self, baseline_kb: int, cap_kb: int, path: str, rank: int):
        self.baseline_kb, self.cap_kb, self.path, self.rank = baseline_kb, cap_kb, path, rank
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.005):
            rss = status_kb("VmRSS") - self.baseline_kb
            if rss > self.cap_kb:
                with open(f"{self.path}.{self.rank}", "w") as f:
                    json.dump({"rank": self.rank, "rss_above_baseline_kb": rss}, f)
                os._exit(3)


def run_setup(mode: str, comm, size: dict, seq: int, global_batch: int, tied: bool = True):
    """``(step, state, model)`` of ``mode`` for the GPT-2 of ``size`` (full parameters built
    here; the caller releases the module's own)."""
    from fsdpx import init_sharded, make_sharded_step, strategies

    model = build_model(size, seq, tied=tied)
    params = {k: v.detach() for k, v in model.named_parameters()}  # tied: one entry
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    strategy = strategies.ALL["zero3" if mode.startswith("zero3") else mode]()
    config = dp_config(global_batch)
    opt = make_optimizer(mode, comm)
    step = make_sharded_step(model, lm_loss, opt, strategy, comm, param_shapes=shapes, config=config,
                             num_examples=NUM_EXAMPLES, donate=True)
    return step, init_sharded(params, opt, strategy, comm, key=0, config=config), model


class FsdpxRunner:
    """One fsdpx mode set up for this rank: ``run()`` is one private step on the global batch
    ``tokens`` (``world x b`` sequences; the step takes this rank's share) and returns the loss;
    ``report()`` what the step says about itself."""

    def __init__(self, mode: str, comm, size: dict, seq: int, tokens, tied: bool, release: bool):
        self.step, self.state, model = run_setup(mode, comm, size, seq, tokens.shape[0], tied)
        self.tokens, self.metrics, self.steps0 = tokens, {}, self.state.step
        if release:
            gc.collect()
            for p in model.parameters():  # the step reads only the sharded state
                p.untyped_storage().resize_(0)

    def run(self) -> float:
        self.state, self.metrics = self.step(self.state, (self.tokens, self.tokens))
        return float(self.metrics["loss"])

    def report(self) -> dict:
        return {"resident_bytes": self.metrics["resident_bytes"], "optimizer_steps": self.state.step - self.steps0,
                "batch_this_rank": self.metrics["batch_size"] // int(os.environ["WORLD_SIZE"])}


class OpacusRunner:
    """``opacus-ghost`` / ``opacus-ghost_fsdp`` set up for this rank, as Opacus 1.6's own
    distributed ghost clipping runs (``opacus/tests/multigpu_fsdpcheck.py``): the untied GPT-2
    wrapped in ``DPDDP`` (or torch's ``DistributedDataParallel`` with ``--opacus-ddp torch``) for
    ``ghost``, in ``opacus.utils.fsdp_utils.FSDP2Wrapper`` for ``ghost_fsdp``;
    ``PrivacyEngine().make_private(module=..., optimizer=torch.optim.AdamW(...),
    criterion=nn.CrossEntropyLoss(), data_loader=..., noise_multiplier=1, max_grad_norm=1,
    grad_sample_mode=...)``, which returns the ghost-clipping module, Opacus's distributed
    optimizer (``DistributedDPOptimizerFastGradientClipping`` / ``FSDPOptimizerFastGradientClipping``)
    and the loss wrapper (``DPLossFastGradientClipping``). The data loader holds the same global
    batch as fsdpx's step, each rank's ``b`` sequences through a ``DistributedSampler``;
    ``poisson_sampling=False`` so every probe's batch is exactly ``b`` (Poisson sampling would
    vary it). ``run()`` is one private step: forward, ``loss.backward()`` (Opacus's two backward
    passes), ``optimizer.step()``."""

    def __init__(self, mode: str, comm, size: dict, seq: int, tokens, ddp_kind: str = "dpddp"):
        import torch
        import torch.nn as nn
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset
        from torch.utils.data.distributed import DistributedSampler

        world, rank = comm.mesh.size, comm.rank
        b = tokens.shape[0] // world
        gsm_mode = mode[len("opacus-"):]
        model = build_model(size, seq, tied=False)
        model.train()
        if gsm_mode == "ghost":
            if ddp_kind == "torch":
                from torch.nn.parallel import DistributedDataParallel

                wrapped = DistributedDataParallel(model)
            else:
                from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

                wrapped = DPDDP(model)
        elif gsm_mode == "ghost_fsdp":
            from opacus.utils.fsdp_utils import FSDP2Wrapper

            wrapped = FSDP2Wrapper(model)  # fully_shard on its default mesh: CPU + gloo here
        else:
            raise ValueError(f"unknown Opacus mode {mode!r}; known: {OPACUS_MODES}")
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)  # after sharding: FSDP2's DTensors
        dataset = TensorDataset(tokens)
        loader = DataLoader(dataset, batch_size=b,
                            sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False))
        self.engine = PrivacyEngine()
        self.module, self.optimizer, self.criterion, loader = self.engine.make_private(
            module=wrapped, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=gsm_mode)
        (self.x,) = next(iter(loader))
        assert tuple(self.x.shape) == (b, seq), self.x.shape
        # transformers builds position_ids of shape (1, T) and broadcasts them over the batch;
        # Opacus's per-example norm of wpe then has 1 row, not b ("stack expects each tensor to
        # be equal size, but got [b] at entry 0 and [1] at entry 1"): give one row per example
        self.positions = torch.arange(seq).repeat(b, 1)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def run(self) -> float:
        x = self.x
        out = self.module(x, position_ids=self.positions)
        logits = out.logits[:, :-1]  # as lm_loss: per-sequence mean next-token cross-entropy
        loss = self.criterion(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                              shape=(x.shape[0], x.shape[1] - 1))
        del out, logits
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def report(self) -> dict:
        import torch

        steps = {int(torch.as_tensor(self.optimizer.original_optimizer.state[p]["step"]).item())
                 if "step" in self.optimizer.original_optimizer.state.get(p, {}) else 0 for p in self.params}
        return {"resident_bytes": None, "optimizer_steps": min(steps) if len(steps) == 1 else sorted(steps),
                "batch_this_rank": int(self.x.shape[0]), "step_skipped": bool(self.optimizer._is_last_step_skipped),
                "accountant_steps": sum(n for _, _, n in self.engine.accountant.history),
                "optimizer": type(self.optimizer).__name__, "module": type(self.module).__name__}


def make_runner(mode: str, comm, size: dict, seq: int, tokens, args, release: bool = True):
    if is_opacus(mode):
        return OpacusRunner(mode, comm, size, seq, tokens, getattr(args, "opacus_ddp", "dpddp"))
    return FsdpxRunner(mode, comm, size, seq, tokens, tied_for(mode, args.untied), release)


def warm_up(mode: str, comm, seq: int, args) -> None:
    """One private step of a tiny GPT-2 in ``mode``, everything dropped after: what a process
    loads once (modules, compiled kernels, thread pools, gloo's buffers) is then resident before
    the baseline is read, so the peak above it is the benchmark model's step."""
    import torch

    world = comm.mesh.size
    tokens = torch.zeros(world, seq, dtype=torch.long)
    make_runner(mode, comm, SMALL, seq, tokens, args, release=False).run()


def worker(args) -> None:
    """One probe on this rank; an exception is also written to ``error.<rank>`` beside
    ``args.over`` (the driver shows it: an Opacus mode that refuses is a result, not a crash)."""
    import torch

    from fsdpx.runtime.dist_comm import init_from_env
    from fsdpx.sharding import Mesh

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    comm = init_from_env(Mesh(dp=world), timeout_s=1800.0)
    try:
        measure(args, comm, world)
    except Exception as e:
        with open(os.path.join(os.path.dirname(args.over), f"error.{comm.rank}"), "w") as f:
            json.dump({"rank": comm.rank, "error": f"{type(e).__name__}: {e}"}, f)
        raise


def measure(args, comm, world: int) -> None:
    import torch
    import torch.distributed as dist

    rank = comm.rank
    size = SMALL if args.small else FULL
    b, seq = args.batch, args.seq
    global_batch = world * b
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab_size"], (global_batch, seq), generator=g)
    warm_up(args.mode, comm, seq, args)  # imports, compiled kernels, thread pools: before the baseline
    gc.collect()
    baseline = status_kb("VmRSS")

    # fsdpx: the sharded state cut from the model, the module's own parameters released;
    # Opacus: the wrapped model and its optimizer (FSDP2 shards the parameters itself)
    runner = make_runner(args.mode, comm, size, seq, tokens, args)
    gc.collect()
    setup_kb = status_kb("VmRSS") - baseline
    reset = reset_hwm()
    if not reset:
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would include set-up")
    dog = Watchdog(baseline, args.cap_mib * 1024, args.over, rank)
    dog.thread.start()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(runner.run())
    seconds = time.perf_counter() - t0
    dog.stop.set()
    dog.thread.join()
    result = {"rank": rank, "baseline_kb": baseline, "setup_kb": setup_kb,
              "peak_kb": status_kb("VmHWM") - baseline, "losses": losses, "seconds": seconds, **runner.report()}
    everyone = comm.all_gather_object(result)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"ranks": everyone}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------

def probe(mode: str, b: int, args) -> dict:
    """One fresh torchrun launch: ``{"fits", "peak_mib" (worst rank, None if cut short), ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        over = os.path.join(tmp, "over")
        wargs = ["--worker", "--mode", mode, "--batch", str(b), "--seq", str(args.seq),
                 "--cap-mib", str(args.cap_mib), "--steps", str(args.steps), "--over", over,
                 "--opacus-ddp", args.opacus_ddp, *(["--small"] if args.small else []),
                 *(["--untied"] if args.untied else [])]
        t0 = time.perf_counter()
        try:
            job = launch_worker(os.path.abspath(__file__), wargs, MALLOC_ENV, args.nproc, log)
        except (subprocess.CalledProcessError, OSError, ValueError) as e:
            marks = [json.load(open(os.path.join(tmp, f))) for f in os.listdir(tmp) if f.startswith("over.")]
            if not marks:
                errors = sorted({json.load(open(os.path.join(tmp, f)))["error"]
                                 for f in os.listdir(tmp) if f.startswith("error.")})
                raise ProbeFailed(f"probe {mode} b={b} failed without passing the cap: {e}; "
                                  f"the workers said: {errors or 'nothing'}", errors) from e
            worst = max(m["rss_above_baseline_kb"] for m in marks)
            return {"batch": b, "fits": False, "cut_short": True, "peak_mib": None,
                    "over_mib": worst / 1024, "wall_s": time.perf_counter() - t0}
    peaks = [r["peak_kb"] / 1024 for r in job["ranks"]]
    steps = [r["optimizer_steps"] for r in job["ranks"]]
    if any(s != args.steps for s in steps) or any(r["batch_this_rank"] != b for r in job["ranks"]) \
            or any(r.get("step_skipped") for r in job["ranks"]):
        raise RuntimeError(f"probe {mode} b={b} did not take {args.steps} private step(s) of {b} sequences "
                           f"per rank: {[{k: v for k, v in r.items() if k != 'losses'} for r in job['ranks']]}")
    return {"batch": b, "fits": max(peaks) <= args.cap_mib, "cut_short": False, "peak_mib": max(peaks),
            "peak_mib_by_rank": peaks, "setup_mib": max(r["setup_kb"] for r in job["ranks"]) / 1024,
            "resident_bytes": [r["resident_bytes"] for r in job["ranks"]],
            "loss": sum(r["losses"][-1] for r in job["ranks"]) / len(job["ranks"]), "losses_by_rank": [r["losses"] for r in job["ranks"]],
            "optimizer_steps": steps, "accountant_steps": job["ranks"][0].get("accountant_steps"),
            "wrapped": {k: job["ranks"][0][k] for k in ("module", "optimizer") if k in job["ranks"][0]},
            "wall_s": time.perf_counter() - t0}


def predicted_mib(mode: str, b: int, args) -> dict[str, float] | None:
    """``fsdpx.runtime.step_memory.step_peak`` of ``mode`` at ``b`` per rank, in MiB; ``None``
    for ZenFlow, whose optimizer copies its state to the host at init, which ``meta`` tensors
    cannot do."""
    if mode == "zero3-zenflow":
        return None
    from fsdpx.runtime.step_memory import step_peak
    from fsdpx.sharding import Mesh, strategies

    size = SMALL if args.small else FULL
    model = build_model(size, args.seq, device="meta", tied=tied_for(mode, args.untied))
    strategy = strategies.ALL["zero3" if mode.startswith("zero3") else mode]()
    global_batch = args.nproc * b
    mesh = Mesh(dp=args.nproc)
    opt = make_optimizer(mode, _MetaGroup(mesh))
    peak = step_peak(model, lm_loss, opt, strategy, mesh, (global_batch, args.seq),
                     config=dp_config(global_batch), num_examples=NUM_EXAMPLES)
    return {k: v / MIB for k, v in peak._asdict().items()}


class ProbeFailed(RuntimeError):
    """A probe's workers failed without passing the cap; ``errors`` are their exceptions."""

    def __init__(self, msg: str, errors: list[str]):
        super().__init__(msg)
        self.errors = errors


class _MetaGroup:
    """A stand-in communicator for building the optimizer of a prediction (ZenFlow's score
    all-reduce is never called on the meta step's first update... if it is, it answers zeros)."""

    def __init__(self, mesh):
        self.mesh, self.rank = mesh, 0

    def run(self, c, x):
        import torch

        return torch.zeros_like(x)


def search(mode: str, args, start: int | None = None) -> dict:
    """The largest fitting batch of ``mode``. fsdpx's modes start from the memory model's
    largest batch under the cap; Opacus's have no prediction and start from ``start`` (the
    other Opacus mode's result when it ran first, else 1). The start only saves probes."""
    probes: list[dict] = []

    def fits(b: int) -> bool:
        rec = probe(mode, b, args)
        probes.append(rec)
        shown = f"peak {rec['peak_mib']:.0f} MiB" if rec["peak_mib"] is not None else \
            f"cut short at {rec['over_mib']:.0f} MiB"
        stepped = "" if rec["cut_short"] else \
            f"; loss {rec['loss']:.4f}, optimizer stepped {rec['optimizer_steps']} on the ranks"
        log(f"{mode} b={b}: {'fits' if rec['fits'] else 'over'} ({shown}, cap {args.cap_mib} MiB, "
            f"{rec['wall_s']:.0f}s{stepped})")
        return rec["fits"]

    if is_opacus(mode):
        guess = max(start or 1, 1)
        log(f"{mode}: no memory model for Opacus; searching from {guess}")
        best, _ = max_fitting(fits, guess=guess, limit=args.limit)
        at = next((p for p in probes if p["batch"] == best), None)
        return {"mode": mode, "tied": False, "max_batch": best, "predicted_max_batch": None, "probes": probes,
                "at_max": at}

    model_mode = "zero3" if mode == "zero3-zenflow" else mode  # ZenFlow: ZeRO-3's prediction as the start
    guess, _ = max_fitting(lambda b: predicted_mib(model_mode, b, args)["total"] <= args.cap_mib, limit=args.limit)
    log(f"{mode}: the memory model ({model_mode}) puts the largest batch under the cap at {guess}; searching from there")
    best, _ = max_fitting(fits, guess=max(guess, 1), limit=args.limit)
    at = next((p for p in probes if p["batch"] == best), None)
    out = {"mode": mode, "tied": tied_for(mode, args.untied), "max_batch": best, "predicted_max_batch": guess,
           "probes": probes, "at_max": at}
    if best >= 1 and mode != "zero3-zenflow":
        out["predicted"] = predicted_mib(mode, best, args)
    first_miss = min((p["batch"] for p in probes if not p["fits"]), default=None)
    if first_miss is not None and mode != "zero3-zenflow":
        out["predicted_first_miss"] = predicted_mib(mode, first_miss, args)
    return out


OPACUS_SNIPPET = r"""
import sys, torch
sys.path.insert(0, {bench!r})
from max_batch import build_model, lm_loss, SMALL, FULL
from opacus.grad_sample import GradSampleModuleFastGradientClipping
model = build_model({size}, {seq})
try:  # the module ghost and ghost_fsdp both wrap the model in (FSDP2 adds its sharding on top)
    gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                               max_grad_norm=1.0, use_ghost_clipping=True)
    x = torch.randint(0, 100, (1, {seq}))
    lm_loss(gsm(x), x).mean().backward()
    print("ran")
except Exception as e:
    print(f"{{type(e).__name__}}: {{e}}")
"""


def opacus_check(args) -> dict[str, str]:
    """Opacus 1.6's ghost clipping on the benchmark's model, unmodified, in a child process:
    ``GradSampleModuleFastGradientClipping`` is the module both ``grad_sample_mode="ghost"``
    (DDP) and ``"ghost_fsdp"`` (its FSDP2 subclass) wrap the model in. Returns what happened."""
    code = OPACUS_SNIPPET.format(bench=os.path.dirname(os.path.abspath(__file__)),
                                 size="SMALL" if args.small else "FULL", seq=args.seq)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stdout.strip().splitlines()
    said = lines[-1] if lines else f"child failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return {"opacus 1.6 ghost / ghost_fsdp on tied GPT-2": said}


OPACUS_NOTES = (
    "Opacus rows: Opacus 1.6 as shipped, on the untied GPT-2 (its ghost clipping refuses the tied one, "
    "last line), wrapped in {ddp} for ghost and opacus.utils.fsdp_utils.FSDP2Wrapper for ghost_fsdp (Opacus's "
    "own distributed tests use DPDDP and FSDP2Wrapper), PrivacyEngine().make_private(torch.optim.AdamW, nn.CrossEntropyLoss, clip 1, noise 1, "
    "poisson_sampling=False: exactly b sequences per rank), one forward + loss.backward() (its two backward "
    "passes) + optimizer.step() per step; position_ids passed per example (transformers' (1, T) positions "
    "give Opacus a 1-row per-example norm for wpe and it fails). What Opacus does with this model: GPT-2's "
    "Conv1D layers (85M of the 162M parameters at full size) have no Opacus norm sampler, so both modes take "
    "their per-example gradients with functorch and then the norms (ghost clipping proper only for the "
    "embeddings and lm_head); FSDP2Wrapper calls fully_shard only on the modules with a sampler or without "
    "trainable parameters (wte, wpe, LayerNorms, lm_head) and leaves the Conv1D weights to the root unit, "
    "which FSDP2 keeps unsharded from the forward to the end of the backward. No memory model for Opacus "
    "(predicted: -); its search starts at the other Opacus mode's result (else 1).")


def table(res: dict) -> str:
    a = res["args"]
    models = sorted({("tied" if r.get("tied", True) else "untied lm_head") for r in res["modes"].values()})
    lines = [f"GPT-2 small shape ({'SMALL smoke config' if a['small'] else '12 layers, d 768, vocab 50257'}; "
             f"{' and '.join(models) or 'tied'}: column 'model'), seq {a['seq']}, private "
             f"(ghost clipping, clip 1, noise 1), AdamW, {a['nproc']} gloo processes, "
             f"cap {a['cap_mib']} MiB per rank (peak VmHWM above the post-import baseline, "
             f"MALLOC_MMAP_THRESHOLD_=65536), {a['steps']} step(s) per probe:", "",
             "| mode | model | max batch per rank | vs its DDP | measured peak at max (MiB) | predicted (MiB) "
             "| pred/meas | first miss: measured / predicted (MiB) | loss at max, optimizer steps by rank "
             "| probes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ddp_of = {False: "ddp", True: "opacus-ghost"}  # the DDP row each family's ratio is over
    for mode, r in res["modes"].items():
        model = "tied" if r.get("tied", True) else "untied lm_head"
        if r.get("refused"):
            lines.append(f"| {mode} | {model} | refused | - | - | - | - | - | - | {r['refused']} |")
            continue
        at, pred = r.get("at_max"), r.get("predicted")
        meas = at["peak_mib"] if at else None
        ptot = pred["total"] if pred else None
        base = res["modes"].get(ddp_of[is_opacus(mode)], {})
        ddp = base.get("max_batch") if base.get("tied", True) == r.get("tied", True) else None
        ratio = f"{r['max_batch'] / ddp:.2f}x" if ddp else "-"
        miss = next((p for p in r["probes"] if not p["fits"] and p["batch"] == min(
            q["batch"] for q in r["probes"] if not q["fits"])), None)
        miss_cell = "-"
        if miss:
            m = f"{miss['peak_mib']:.0f}" if miss["peak_mib"] is not None else f">{miss['over_mib']:.0f} (cut)"
            pm = r.get("predicted_first_miss")
            miss_cell = f"b={miss['batch']}: {m} / {pm['total']:.0f}" if pm else f"b={miss['batch']}: {m} / -"
        stepped = f"{at['loss']:.4f}, {at['optimizer_steps']}" if at else "-"
        probes = " ".join(str(p["batch"]) + ("+" if p["fits"] else "-") for p in r["probes"])
        pcells = f"{ptot:.0f} | {ptot / meas:.3f}" if meas and ptot else "- | -"
        lines.append(f"| {mode} | {model} | {r['max_batch']} | {ratio} | {f'{meas:.0f}' if meas else '-'} | "
                     f"{pcells} | {miss_cell} | {stepped} | {probes} |")
    pairs = [(f"fsdpx zero3 / ddp", "zero3", "ddp"), ("Opacus ghost_fsdp / ghost", "opacus-ghost_fsdp", "opacus-ghost")]
    shown = []
    for name, num, den in pairs:
        rn, rd = res["modes"].get(num, {}), res["modes"].get(den, {})
        if rn.get("max_batch") is not None and rd.get("max_batch") and rn.get("tied") == rd.get("tied"):
            shown.append(f"{name} = {rn['max_batch']} / {rd['max_batch']} = {rn['max_batch'] / rd['max_batch']:.2f}x "
                         f"({'tied' if rn.get('tied') else 'untied'})")
    if shown:
        lines += ["", "Sharded over DDP, largest batch per rank: " + "; ".join(shown) + "."]
    lines += ["", "Probes: batch per rank, + fits, - over the cap (in order; fsdpx's search starts at the memory "
              "model's largest batch under the cap). 'vs its DDP': fsdpx rows over fsdpx ddp, Opacus rows over "
              "opacus-ghost, on the same model. Loss: the mean over the ranks of the last step's loss (fsdpx's is "
              "the global mean on every rank, Opacus's each rank's own b sequences). Optimizer steps: the steps "
              "each rank's optimizer took in the probe at the max (fsdpx: the state's step count; Opacus: AdamW's step count on every parameter). "
              "zero3-zenflow has no prediction (its optimizer copies state to the host at init, which meta tensors "
              "cannot do); on a CPU its host state is the same RSS."]
    if any(is_opacus(m) for m in res["modes"]):
        lines += ["", OPACUS_NOTES.format(ddp="torch's DistributedDataParallel" if a.get("opacus_ddp") == "torch"
                                          else "opacus.distributed.DifferentiallyPrivateDistributedDataParallel")]
    parts = [f"{m}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["predicted"].items())
             for m, r in res["modes"].items() if r.get("predicted")]
    if parts:
        lines += ["", "Predicted parts at the max batch (MiB): " + "; ".join(parts)]
    if res.get("opacus"):
        lines += ["", "Opacus 1.6 on the tied model: " + "; ".join(f"{k}: {v}" for k, v in res["opacus"].items())]
    return "\n".join(lines)


def driver(args) -> None:
    res: dict[str, Any] = {"args": vars(args), "load_start": os.getloadavg(), "modes": {}}
    t0 = time.perf_counter()
    for mode in args.modes.split(","):
        log(f"searching {mode}")
        start = max((r["max_batch"] for m, r in res["modes"].items() if is_opacus(m) and r.get("max_batch")),
                    default=None)
        try:
            res["modes"][mode] = search(mode, args, start=start)
        except ProbeFailed as e:
            if not is_opacus(mode):
                raise
            # Opacus refusing (or failing) on this setting is a result: its own words go in the table
            said = "; ".join(e.errors) or str(e)
            log(f"{mode}: refused: {said}")
            res["modes"][mode] = {"mode": mode, "tied": False, "max_batch": None, "refused": said, "probes": []}
            continue
        log(f"{mode}: max batch per rank {res['modes'][mode]['max_batch']}")
    if not args.skip_opacus:
        res["opacus"] = opacus_check(args)
    res["wall_s"] = time.perf_counter() - t0
    res["load_end"] = os.getloadavg()
    text = table(res)
    print(text)
    log(f"done in {res['wall_s']:.0f}s; load {res['load_start'][0]:.1f} -> {res['load_end'][0]:.1f}")
    write_report(args.out, res, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny GPT-2 and a small cap, to check the script")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, from {MODES + OPACUS_MODES} (default: fsdpx's three)")
    ap.add_argument("--untied", action="store_true",
                    help="fsdpx's modes on GPT-2 with its own lm_head (tie_word_embeddings=False), the model "
                         "the Opacus modes always use")
    ap.add_argument("--opacus-ddp", choices=["dpddp", "torch"], default="dpddp",
                    help="the DDP wrapper of opacus-ghost: Opacus's DPDDP (default; what its distributed ghost "
                         "tests and its FSDP comparison use) or torch's DistributedDataParallel")
    ap.add_argument("--cap-mib", type=int, default=None, help="per-rank cap (default 2560; --small 48)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 128; --small 32)")
    ap.add_argument("--steps", type=int, default=1, help="private steps per probe")
    ap.add_argument("--limit", type=int, default=256, help="largest batch per rank tried")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--skip-opacus", action="store_true")
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--over", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES + OPACUS_MODES]
    if unknown and not args.worker:
        ap.error(f"unknown mode(s) {unknown}; known: {MODES + OPACUS_MODES}")
    if args.cap_mib is None:
        args.cap_mib = 48 if args.small else 2560
    if args.seq is None:
        args.seq = 32 if args.small else 128
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
