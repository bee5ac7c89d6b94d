"""Benchmark: wall time and peak memory of ONE optimizer step, private and not, on a GPT.

Models (``--model``): ``gpt`` (fsdpx's own, the default), ``hf-gpt2`` (transformers'
GPT2LMHeadModel: Conv1D, tied embeddings, position ids ``[1, T]``), ``hf-llama``
(LlamaForCausalLM: RMSNorm, rotary, grouped-query attention), ``plain-gpt`` (``plain_gpt.py``, a
GPT written the ordinary way), all from configs built here at the config's shape, nothing
downloaded. ``--precision bf16`` runs every mode's forward under autocast to bf16
(``privacy.precision.compute_in``). A mode that cannot run a model (Opacus ghost refuses tied
weights) is reported as skipped with the reason it gave.

Modes (all on the same initial weights, the same fixed batch and the same AdamW
hyper-parameters):

  torch             non-private: ``token_loss(model(x), y).mean().backward()`` + ``torch.optim.AdamW``
  fsdpx-vmap        ``privacy.step.make_private_step`` with ``method="vmap"``
  fsdpx-ghost       ``make_private_step`` with ``method="auto"`` (ghost, vmap only for rule-less layers)
  (both fsdpx modes with ``donate=True``: AdamW writes into the state in place, as torch.optim does)
  opacus-hooks      Opacus ``make_private(grad_sample_mode="hooks")`` + AdamW
  opacus-ghost      Opacus ``make_private(grad_sample_mode="ghost")``: the criterion it returns
                    packages both backward passes in ``loss.backward()``
  fsdpx-ghost-tied  fsdpx-ghost on the model with tied embeddings (Opacus ghost refuses tied
                    weights, so the comparison rows use ``tie_weights=False``)

Private modes use noise multiplier 1.0 and clip norm 1.0; fsdpx's expected batch size
(``sample_rate * num_examples``) equals the fixed batch size, Opacus runs with
``poisson_sampling=False`` on a loader of that one batch. Every mode is checked to train (loss
finite, every parameter tensor changed) on its first warm-up step, before anything is timed.

Devices: ``--device cpu`` (default) or ``--device cuda``: models, batch, per-example norms,
clipping, optimizers and Opacus all on the GPU; fsdpx's noise (a pure function of key, step,
parameter and element) is drawn on the GPU in torch ops (``privacy.ziggurat_ops``; until scheme
v3 it was drawn on the host and copied). Configs: small
and large (the CPU's), gpu (GPT-2 small's shape, the default on cuda), smoke (tiny, for
``--smoke``: one warm-up step, one round, one memory step, on either device).

Timing: warm-up steps, then ``--steps`` rounds; in each round every mode runs one step, so load
from other processes hits all modes alike (on cuda the device is synchronised before each clock
read). Reported: median seconds per step and its ratio to
the non-private median, the median of same-round wall ratios, and the median of same-round
ratios of process CPU time (all threads; time the hypervisor steals from this VM is not in it,
which makes it the steadier figure on a shared machine). Memory on cpu: each mode runs alone in a fresh process
(``--memory-mode MODE``, started by the parent with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc
hands freed blocks back); the peak resident set over the baseline taken after the model and the
batch exist (the high-water mark is reset there through ``/proc/self/clear_refs``). Memory on
cuda: each mode in turn in the same process once the timing is done, the peak of
``torch.cuda.max_memory_allocated`` over the allocation after the model and the batch exist
(``reset_peak_memory_stats`` there, after ``empty_cache``).

    .venv/bin/python benchmarks/privacy_step.py --config small              # table on stdout
    .venv/bin/python benchmarks/privacy_step.py --config small --steps 2 --warmup 1 --no-memory
    .venv/bin/python benchmarks/privacy_step.py --smoke                     # every mode once, tiny model
    .venv/bin/python benchmarks/privacy_step.py --model hf-llama --precision bf16 --steps 20
    .venv/bin/python benchmarks/privacy_step.py --config small --profile    # + torch.profiler tables
    .venv/bin/python benchmarks/privacy_step.py --config both --phases      # where the private step's time goes
    GLIBC_TUNABLES=glibc.malloc.check=0 .venv/bin/python benchmarks/privacy_step.py --phases  # the same, malloc left
                        # as glibc's defaults (the environment configures malloc: privacy/host_pages.py then sets nothing)
    python3 benchmarks/privacy_step.py --device cuda --smoke && \
        python3 benchmarks/privacy_step.py --device cuda --steps 10 --out privacy_step_gpu.json

Progress goes to stderr; the markdown tables to stdout; ``--out FILE.json`` keeps the raw numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_common import logger, median_ratio, reset_hwm, status_kb  # noqa: E402
from fsdpx.models.gpt import GPT, GPTConfig, token_loss  # noqa: E402
from fsdpx.optim import Optimizer, adamw  # noqa: E402
from plain_gpt import PlainGPT  # noqa: E402
from privacy.precision import PRECISIONS, compute_in  # noqa: E402
from privacy.step import DPConfig, init_state, make_private_step  # noqa: E402

CONFIGS: dict[str, dict[str, int]] = {
    "small": dict(vocab=8192, d_model=256, n_layer=4, n_head=4, seq=128, batch=16),
    # The issue does not give the head count of the larger model; 8 keeps the head width at 64.
    "large": dict(vocab=8192, d_model=512, n_layer=6, n_head=8, seq=256, batch=8),
    # --device cuda: GPT-2 small's shape (untied: 163M parameters), a batch of 8 x 512 tokens, so
    # an H100's fp32 non-private step takes tens of milliseconds
    "gpu": dict(vocab=50257, d_model=768, n_layer=12, n_head=12, seq=512, batch=8),
    # --smoke: every mode and the memory path once, in seconds, on either device
    "smoke": dict(vocab=512, d_model=64, n_layer=2, n_head=2, seq=32, batch=4),
}
MODELS = ("gpt", "hf-gpt2", "hf-llama", "plain-gpt")
"""--model: fsdpx's own GPT; transformers' GPT2LMHeadModel (Conv1D, learned positions, tied
embeddings, as GPT-2 ships) and LlamaForCausalLM (RMSNorm, rotary, grouped-query attention: half
as many key/value heads as heads), both from configs built here (nothing downloaded), dropout 0
and SDPA attention; the GPT a user writes (``plain_gpt.py``). Each at the config's shape."""
ALWAYS_TIED = frozenset({"hf-gpt2"})  # GPT-2's LM head is its token embedding in every mode
MODES = ("torch", "fsdpx-vmap", "fsdpx-ghost", "opacus-hooks", "opacus-ghost", "fsdpx-ghost-tied")
BASELINE = "torch"

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
NOISE_MULTIPLIER, CLIP_NORM = 1.0, 1.0
NUM_EXAMPLES = 1024  # fsdpx: sample_rate = batch / NUM_EXAMPLES, so the expected batch is the batch
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


log = logger()


# --------------------------------------------------------------------------- model and batch


def build_model(cfg: dict[str, int], *, tied: bool, device: str = "cpu", model: str = "gpt",
                precision: str = "fp32") -> torch.nn.Module:
    """The same initial weights for every mode and device (seeded on the CPU, then moved);
    ``tied`` shares the token embedding and the LM head (always, for ``hf-gpt2``). ``model`` is
    one of :data:`MODELS`; ``precision`` ``"bf16"`` puts its forward under autocast to bf16
    (``privacy.precision.compute_in``: fp32 parameters, logits cast back to fp32), in every mode."""
    torch.manual_seed(0)
    tied = tied or model in ALWAYS_TIED
    V, T, L, H, C = cfg["vocab"], cfg["seq"], cfg["n_layer"], cfg["n_head"], cfg["d_model"]
    if model == "gpt":
        net = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, tie_weights=tied))
    elif model == "plain-gpt":
        net = PlainGPT(V, T, C, L, H, tied=tied)
    elif model == "hf-gpt2":
        import transformers

        net = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa"))
    elif model == "hf-llama":
        import transformers

        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=C, intermediate_size=(8 * C // 3 + 63) // 64 * 64, num_hidden_layers=L,
            num_attention_heads=H, num_key_value_heads=max(1, H // 2), max_position_embeddings=T,
            tie_word_embeddings=tied, use_cache=False, attn_implementation="sdpa"))
    else:
        raise ValueError(f"unknown model {model!r}: one of {MODELS}")
    return compute_in(net, precision).to(device)


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model's output: a transformers ``CausalLMOutput``'s ``.logits``, else the output."""
    return getattr(out, "logits", out)


def step_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Per-example loss ``(B,)`` of any of the models: the mean next-token cross-entropy."""
    return token_loss(logits_of(out), targets)


def build_batch(cfg: dict[str, int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of next-token pairs drawn from random token streams (the same on every device)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def sync(device: str) -> None:
    """Wait for the device's queued work, so that a clock read after it counts that work."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed(runner: Runner, device: str) -> tuple[float, float, float]:
    """One step: ``(loss, wall s, process CPU s)``, the device synchronised before each clock read."""
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = runner.step()
    sync(device)
    return loss, time.perf_counter() - t0, time.process_time() - c0


def tied_mode(mode: str) -> bool:
    return mode.endswith("-tied")


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied tensor once


def vmap_bytes(cfg: dict[str, int], model: torch.nn.Module) -> int:
    """Per-example gradients of the whole model, float32: the dominant term of method='vmap'."""
    return cfg["batch"] * num_params(model) * 4


# --------------------------------------------------------------------------- one step per mode


def _phase(name: str):
    return torch.profiler.record_function(name)


class Runner:
    """One training setup. ``step()`` runs one optimizer step and returns the batch's mean loss;
    ``params()`` returns the current parameters (for the "does it train" check)."""

    norm: float | None = None  # mean per-example gradient norm of the last step, when the mode has one

    def step(self) -> float:
        raise NotImplementedError

    def params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class TorchRunner(Runner):
    def __init__(self, model: GPT, batch, annotate: bool = False):
        self.model, self.batch, self.annotate = model, batch, annotate
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def step(self) -> float:
        x, y = self.batch
        ctx = _phase if self.annotate else (lambda _: contextlib.nullcontext())
        self.opt.zero_grad(set_to_none=True)
        with ctx("torch.forward"):
            loss = step_loss(self.model(x), y).mean()
        with ctx("torch.backward"):
            loss.backward()
        with ctx("torch.optimizer"):
            self.opt.step()
        return float(loss.detach())

    def params(self):
        return dict(self.model.named_parameters())


class FsdpxRunner(Runner):
    def __init__(self, model: GPT, batch, method: str, annotate: bool = False):
        self.batch = batch
        batch_size = batch[1].shape[0]
        config = DPConfig(clip_norm=CLIP_NORM, noise_multiplier=NOISE_MULTIPLIER,
                          sample_rate=batch_size / NUM_EXAMPLES, method=method)
        assert config.sample_rate * NUM_EXAMPLES == batch_size
        opt = adamw(LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        if annotate:  # label the optimizer phase for the profiler; same arithmetic
            inner = opt.update

            def update(grads, state, params):
                with _phase("fsdpx.optimizer"):
                    return inner(grads, state, params)

            opt = Optimizer(opt.init, update)
        self.step_fn = make_private_step(model, step_loss, opt, config, num_examples=NUM_EXAMPLES, donate=True)
        self.state = init_state(dict(model.named_parameters()), opt, key=0, config=config)

    def step(self) -> float:
        self.state, metrics = self.step_fn(self.state, self.batch)
        self.norm = metrics["mean_norm"]
        return metrics["loss"]

    def params(self):
        return self.state.params


class OpacusRunner(Runner):
    def __init__(self, model: GPT, batch, grad_sample_mode: str, annotate: bool = False):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        self.model, self.batch, self.annotate = model, batch, annotate
        self.ghost = grad_sample_mode == "ghost"
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        # poisson_sampling=False: the loader is left as it is; one batch per "epoch", so
        # Opacus's expected batch size (the divisor of the noised sum) is the batch size.
        loader = DataLoader(TensorDataset(*batch), batch_size=batch[1].shape[0])
        engine = PrivacyEngine()
        kw = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=NOISE_MULTIPLIER,
                  max_grad_norm=CLIP_NORM, poisson_sampling=False, grad_sample_mode=grad_sample_mode)
        if self.ghost:  # documented ghost usage: make_private returns a criterion wrapper too
            self.module, self.opt, self.criterion, _ = engine.make_private(criterion=torch.nn.CrossEntropyLoss(), **kw)
        else:
            self.module, self.opt, _ = engine.make_private(**kw)

    def step(self) -> float:
        x, y = self.batch
        ctx = _phase if self.annotate else (lambda _: contextlib.nullcontext())
        self.opt.zero_grad(set_to_none=True)
        with ctx("opacus.forward"):
            logits = logits_of(self.module(x))
            if self.ghost:  # per-sequence privacy unit: `shape` folds the B*T token losses to B
                B, T, V = logits.shape
                loss = self.criterion(logits.reshape(B * T, V), y.reshape(B * T), shape=(B, T, V))
            else:
                loss = step_loss(logits, y).mean()
        with ctx("opacus.backward"):  # ghost: both backward passes happen in here
            loss.backward()
        with ctx("opacus.optimizer"):  # hooks: clip per-example grads, sum, noise, AdamW
            self.opt.step()
        if self.ghost:
            self.norm = float(self.module.per_sample_gradient_norms.mean())
        return float(loss.detach())

    def params(self):
        return dict(self.model.named_parameters())


def default_modes(model: str) -> list[str]:
    """Every mode; the extra tied row only on fsdpx's GPT (hf-gpt2 is tied in every mode)."""
    return list(MODES) if model == "gpt" else [m for m in MODES if not tied_mode(m)]


def make_runner(mode: str, model: GPT, batch, annotate: bool = False) -> Runner:
    if mode == "torch":
        return TorchRunner(model, batch, annotate)
    if mode == "fsdpx-vmap":
        return FsdpxRunner(model, batch, "vmap", annotate)
    if mode in ("fsdpx-ghost", "fsdpx-ghost-tied"):
        return FsdpxRunner(model, batch, "auto", annotate)
    if mode in ("opacus-hooks", "opacus-ghost"):
        return OpacusRunner(model, batch, mode.split("-")[1], annotate)
    raise ValueError(f"unknown mode {mode!r}")


def snapshot(runner: Runner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in runner.params().items()}


def check_trains(mode: str, runner: Runner, before: dict[str, torch.Tensor], loss: float) -> None:
    """Raise unless the step gave a finite loss and changed every parameter tensor."""
    after = runner.params()
    if not math.isfinite(loss):
        raise RuntimeError(f"{mode}: loss is not finite ({loss})")
    unchanged = [k for k, v in before.items() if torch.equal(v, after[k].detach())]
    if unchanged:
        raise RuntimeError(f"{mode}: parameters did not change: {unchanged}")
    if not all(torch.isfinite(v).all() for v in after.values()):
        raise RuntimeError(f"{mode}: non-finite parameters after one step")


def skip_reason(mode: str, cfg: dict[str, int], model: GPT, max_mem_gb: float) -> str | None:
    if mode == "fsdpx-vmap":
        need = vmap_bytes(cfg, model) / 2**30
        if need > max_mem_gb:
            return f"per-example gradients alone need {need:.1f} GB > {max_mem_gb:g} GB limit"
    return None


def max_mem_gb(arg: float | None, device: str) -> float:
    """The vmap guard's limit: ``--max-mem-gb``, else 16 GB of host memory on the CPU and half
    the GPU's memory on CUDA (the other modes' models and states share the device)."""
    if arg is not None:
        return arg
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / 2 / 2**30
    return 16.0


# --------------------------------------------------------------------------- timing


def time_config(name: str, cfg: dict[str, int], modes: list[str], args) -> dict[str, Any]:
    device = args.device
    batch = build_batch(cfg, device)
    runners: dict[str, Runner] = {}
    result: dict[str, Any] = {}
    for mode in modes:
        model = build_model(cfg, tied=tied_mode(mode), device=device, model=args.model, precision=args.precision)
        reason = skip_reason(mode, cfg, model, args.max_mem_gb)
        if reason:
            log(f"[{name}] {mode}: skipped ({reason})")
            result[mode] = {"skipped": reason, "times": []}
            continue
        try:
            runners[mode] = make_runner(mode, model, batch)
        except Exception as e:  # Opacus refuses some models (tied weights under ghost): say why
            result[mode] = {"skipped": refusal(e), "times": []}
            log(f"[{name}] {mode}: skipped ({result[mode]['skipped']})")
            continue
        result[mode] = {"times": [], "cpu_times": [], "warmup_times": [], "params": num_params(model)}

    # First warm-up step of each mode: also the check that it trains. A mode slower than the
    # limit is measured once and then skipped.
    for mode, runner in list(runners.items()):
        log(f"[{name}] {mode}: warm-up 1/{args.warmup} (+ check that it trains)")
        before = snapshot(runner)
        gc.collect()
        try:
            loss, dt, _ = timed(runner, device)
        except Exception as e:  # a mode that cannot run this model (vmap through its masks, say)
            result[mode]["skipped"] = refusal(e)
            log(f"[{name}] {mode}: skipped ({result[mode]['skipped']})")
            del runners[mode]
            continue
        check_trains(mode, runner, before, loss)
        del before
        result[mode].update(first_loss=loss, first_mean_norm=runner.norm)
        result[mode]["warmup_times"].append(dt)
        log(f"[{name}] {mode}: {dt:.3f} s, loss {loss:.4f}, every parameter changed")
        if dt > args.max_step_s:
            result[mode]["skipped"] = f"one step took {dt:.1f} s > {args.max_step_s:g} s limit"
            log(f"[{name}] {mode}: skipped ({result[mode]['skipped']})")
            del runners[mode]
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()

    def round_(label: str, key: str, i: int, n: int) -> None:
        for mode, runner in runners.items():
            gc.collect()
            _, dt, cpu = timed(runner, device)
            result[mode][key].append(dt)
            if key == "times":
                result[mode]["cpu_times"].append(cpu)
            log(f"[{name}] {label} {i + 1}/{n} {mode}: {dt:.3f} s (CPU {cpu:.3f} s)")

    for i in range(1, args.warmup):
        round_("warm-up", "warmup_times", i, args.warmup)
    for i in range(args.steps):
        round_("step", "times", i, args.steps)

    base = result.get(BASELINE, {}).get("times") or None
    for mode, r in result.items():
        if r["times"]:
            r["median_s"] = statistics.median(r["times"])
            r["min_s"] = min(r["times"])
            r["ratio"] = r["median_s"] / statistics.median(base) if base else None
            r["paired_ratio"] = paired_ratio(r["times"], base)
            r["paired_cpu_ratio"] = paired_ratio(r["cpu_times"], result.get(BASELINE, {}).get("cpu_times"))
    return result


def refusal(e: BaseException) -> str:
    """One line saying why a mode could not run: the exception's type and first line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:160]}"


def paired_ratio(times: list[float], base: list[float] | None) -> float | None:
    """Median over rounds of (this mode's step / the baseline's step in the same round): the
    two ran seconds apart, so slow drifts of the machine's load cancel."""
    if not base or len(base) != len(times):
        return None
    return median_ratio(times, base)


# --------------------------------------------------------------------------- memory


def memory_child(mode: str, name: str, steps: int, max_mem_gb: float, model_name: str = "gpt",
                 precision: str = "fp32") -> dict[str, Any]:
    """Runs in its own process: peak RSS of setup + ``steps`` steps over the model+batch baseline."""
    cfg = CONFIGS[name]
    model = build_model(cfg, tied=tied_mode(mode), model=model_name, precision=precision)
    batch = build_batch(cfg)
    reason = skip_reason(mode, cfg, model, max_mem_gb)
    if reason:
        return {"mode": mode, "skipped": reason}
    gc.collect()
    baseline_kb = status_kb("VmRSS")
    if reset_hwm():  # reset the high-water mark to the current RSS (Linux >= 4.0)
        method = "VmHWM after clear_refs"
    else:
        method = "ru_maxrss (includes model construction if it peaked higher)"
    runner = make_runner(mode, model, batch)
    for i in range(steps):
        t0 = time.perf_counter()
        runner.step()
        log(f"[{name}] memory {mode} step {i + 1}/{steps}: {time.perf_counter() - t0:.3f} s, "
            f"RSS {status_kb('VmRSS') / 1024:.0f} MB")
    peak_kb = status_kb("VmHWM")
    if method.startswith("ru_maxrss"):
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "baseline_mb": baseline_kb / 1024, "peak_mb": peak_kb / 1024,
            "delta_mb": (peak_kb - baseline_kb) / 1024, "steps": steps, "method": method}


def memory_config(name: str, modes: list[str], args, timing: dict[str, Any]) -> dict[str, Any]:
    out = {}
    env = {**os.environ, **MALLOC_ENV}
    for mode in modes:
        if timing.get(mode, {}).get("skipped"):  # too slow or too big: do not run it again
            out[mode] = {"mode": mode, "skipped": "skipped in timing"}
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-mode", mode, "--config", name,
               "--memory-steps", str(args.memory_steps), "--max-mem-gb", str(args.max_mem_gb),
               "--model", args.model, "--precision", args.precision]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        log(f"[{name}] memory: {mode} in its own process")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            out[mode] = {"mode": mode, "error": f"exit code {proc.returncode}"}
            continue
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def memory_config_cuda(name: str, modes: list[str], args, timing: dict[str, Any]) -> dict[str, Any]:
    """CUDA: each mode in turn in this process (the timing runners are gone by now): the peak
    of ``torch.cuda.max_memory_allocated`` over setup + ``--memory-steps`` steps, above what is
    allocated once the model and the batch exist (the peak is reset there)."""
    cfg, out = CONFIGS[name], {}
    for mode in modes:
        if timing.get(mode, {}).get("skipped"):
            out[mode] = {"mode": mode, "skipped": "skipped in timing"}
            continue
        model = build_model(cfg, tied=tied_mode(mode), device="cuda", model=args.model, precision=args.precision)
        batch = build_batch(cfg, "cuda")
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner = make_runner(mode, model, batch)
        for i in range(args.memory_steps):
            _, dt, _ = timed(runner, "cuda")
            log(f"[{name}] memory {mode} step {i + 1}/{args.memory_steps}: {dt:.3f} s, "
                f"GPU peak {(torch.cuda.max_memory_allocated() - baseline) / 2**20:.0f} MB over the baseline")
        peak = torch.cuda.max_memory_allocated()
        out[mode] = {"mode": mode, "baseline_mb": baseline / 2**20, "peak_mb": peak / 2**20,
                     "delta_mb": (peak - baseline) / 2**20, "steps": args.memory_steps,
                     "method": "torch.cuda.max_memory_allocated after reset_peak_memory_stats, in process"}
        del runner, model, batch
        gc.collect()
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- profile


@contextlib.contextmanager
def fsdpx_phase_labels():
    """Wrap the functions the private step calls in profiler labels (module attributes are
    looked up at call time, so the step itself is unchanged); restored on exit."""
    import privacy.clipping as clipping
    import privacy.contributions as contributions
    import privacy.step as step

    targets = [
        (step, "clip_and_sum", "fsdpx.clip_and_sum (all of clipping)"),
        (step, "add_gaussian_noise_", "fsdpx.noise"),
        (clipping, "record", "fsdpx.tape: forward + backward to layer outputs"),
        (clipping, "contributions", "fsdpx.ghost rules"),
        (clipping, "_sq_norms", "fsdpx.per-example norms"),
        (clipping, "guarded_clip_factors", "fsdpx.clip factors"),
        (clipping, "stream_clipped_sums", "fsdpx.streamed norms and clipped sums (LM head)"),
        (contributions, "instantiate_for_reuse", "fsdpx.per-example grads kept for reuse"),
        (clipping, "per_sample_grads", "fsdpx.vmap per-example grads"),
        (contributions, "weighted_sum", "fsdpx.clipped sum (weight grads)"),
    ]
    saved = []
    for module, attr, label in targets:
        fn = getattr(module, attr)
        saved.append((module, attr, fn))

        def wrapped(*a, __fn=fn, __label=label, **kw):
            with _phase(__label):
                return __fn(*a, **kw)

        setattr(module, attr, wrapped)

    def per_parameter(attr: str, label: str) -> None:
        # one label per parameter shape (and "ids" for an embedding's one-hot part), so the
        # table shows which weights the norms and clipped sums spend their time on
        fn = getattr(contributions, attr)
        saved.append((contributions, attr, fn))

        def wrapped(parts, *a, **kw):
            shape = list(a[-1] if attr == "weighted_sum" else a[0])
            ids = " ids" if any(getattr(p, "one_hot", False) for p in parts) else ""
            with _phase(f"fsdpx.{label} {shape}{ids}"):
                return fn(parts, *a, **kw)

        setattr(contributions, attr, wrapped)

    per_parameter("sq_norms", "norm of")
    per_parameter("weighted_sum", "clipped sum of")
    try:
        yield
    finally:
        for module, attr, fn in reversed(saved):
            setattr(module, attr, fn)


def profile_config(name: str, cfg: dict[str, int], modes: list[str], args) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    device = args.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    batch = build_batch(cfg, device)
    out = {}
    for mode in modes:
        model = build_model(cfg, tied=tied_mode(mode), device=device, model=args.model, precision=args.precision)
        runner = make_runner(mode, model, batch, annotate=True)
        for i in range(args.warmup):
            log(f"[{name}] profile {mode}: warm-up {i + 1}/{args.warmup}")
            runner.step()
        log(f"[{name}] profile {mode}: profiled step")
        labels = fsdpx_phase_labels() if mode.startswith("fsdpx") else contextlib.nullcontext()
        gc.collect()
        with labels, profile(activities=activities) as prof:
            _, wall, _ = timed(runner, device)
        events = prof.key_averages()
        phases = sorted(((e.key, e.cpu_time_total / 1e3) for e in events if e.key.split(".")[0] in
                         ("torch", "fsdpx", "opacus") and not e.key.startswith("torch.ops")),
                        key=lambda kv: -kv[1])
        ops = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events if e.key.startswith("aten::")),
                     key=lambda kv: -kv[1])[: args.profile_top]
        per_param = [kv for kv in phases if " of [" in kv[0]][: args.profile_top]
        phases = [kv for kv in phases if " of [" not in kv[0]]
        out[mode] = {"wall_s": wall, "phases_ms": phases, "per_parameter_ms": per_param, "top_ops_self_ms": ops}
        del runner
        gc.collect()
    return out


# --------------------------------------------------------------------------- report


LABELS = {
    "torch": "non-private torch (AdamW)",
    "fsdpx-vmap": "fsdpx vmap",
    "fsdpx-ghost": "fsdpx ghost (auto)",
    "opacus-hooks": "Opacus 1.6 hooks",
    "opacus-ghost": "Opacus 1.6 ghost",
    "fsdpx-ghost-tied": "fsdpx ghost (auto), tied embeddings (extra)",
}


def table(name: str, cfg: dict[str, int], timing: dict[str, Any], memory: dict[str, Any], device: str = "cpu") -> str:
    c = cfg
    head = (f"**{name}**: vocab {c['vocab']}, d_model {c['d_model']}, {c['n_layer']} layers, {c['n_head']} heads, "
            f"seq {c['seq']}, batch {c['batch']}; untied embeddings unless stated\n\n")
    peak = "peak GPU MB over baseline (max_memory_allocated)" if device == "cuda" else "peak MB over baseline"
    rows = ["| mode | median s/step | min s | ratio of medians to non-private | median of per-round ratios "
            f"| per-round ratios of CPU time | {peak} | first-step loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = timing.get(BASELINE, {}).get("times")
    for mode in timing or memory:
        t, m = timing.get(mode, {}), memory.get(mode, {})
        if t.get("times"):
            med, mn, ratio = f"{t['median_s']:.3f}", f"{t['min_s']:.3f}", f"{t['ratio']:.2f}x" if t.get("ratio") else "-"
            paired = paired_ratio(t["times"], base)
            paired = f"{paired:.2f}x" if paired else "-"
            cpu = paired_ratio(t.get("cpu_times", []), timing.get(BASELINE, {}).get("cpu_times"))
            cpu = f"{cpu:.2f}x" if cpu else "-"
        elif t.get("skipped"):
            med, mn, ratio, paired, cpu = f"skipped: {t['skipped']}", "-", "-", "-", "-"
        else:
            med = mn = ratio = paired = cpu = "-"
        if "delta_mb" in m:
            mem = f"{m['delta_mb']:.0f}"
        else:
            mem = m.get("skipped") or m.get("error") or "-"
        loss = f"{t['first_loss']:.4f}" if "first_loss" in t else "-"
        rows.append(f"| {LABELS.get(mode, mode)} | {med} | {mn} | {ratio} | {paired} | {cpu} | {mem} | {loss} |")
    text = head + "\n".join(rows) + "\n"
    og, fg = timing.get("opacus-ghost", {}), timing.get("fsdpx-ghost", {})
    if og.get("median_s") and fg.get("median_s"):
        text += f"\nOpacus ghost / fsdpx ghost (time): {og['median_s'] / fg['median_s']:.2f}x"
        if "delta_mb" in memory.get("opacus-ghost", {}) and "delta_mb" in memory.get("fsdpx-ghost", {}):
            text += f"; fsdpx ghost peak memory / Opacus ghost: " \
                    f"{memory['fsdpx-ghost']['delta_mb'] / memory['opacus-ghost']['delta_mb']:.2f}x"
        text += "\n"
    vm = timing.get("fsdpx-vmap", {})
    if vm.get("median_s") and fg.get("median_s"):
        text += f"fsdpx vmap / fsdpx ghost (time): {vm['median_s'] / fg['median_s']:.2f}x"
        if "delta_mb" in memory.get("fsdpx-vmap", {}) and memory.get("fsdpx-ghost", {}).get("delta_mb"):
            text += f"; peak memory: {memory['fsdpx-vmap']['delta_mb'] / memory['fsdpx-ghost']['delta_mb']:.2f}x"
        text += "\n"
    norms = {m: t["first_mean_norm"] for m, t in timing.items() if t.get("first_mean_norm") is not None}
    if norms:
        text += "First-step mean per-example gradient norm (same weights, same batch): " + \
                ", ".join(f"{m} {v:.4f}" for m, v in norms.items()) + "\n"
    return text


def profile_tables(prof: dict[str, Any]) -> str:
    text = ""
    for mode, p in prof.items():
        text += f"\n**profile {mode}** (one step under torch.profiler: {p['wall_s']:.3f} s)\n\n"
        if p["phases_ms"]:
            text += "| phase | CPU total ms |\n|---|---:|\n"
            text += "".join(f"| {k} | {v:.1f} |\n" for k, v in p["phases_ms"])
            text += "\n"
        if p.get("per_parameter_ms"):
            text += "| per parameter shape (summed over parameters of that shape) | CPU total ms |\n|---|---:|\n"
            text += "".join(f"| {k} | {v:.1f} |\n" for k, v in p["per_parameter_ms"])
            text += "\n"
        text += "| op | self CPU ms | calls |\n|---|---:|---:|\n"
        text += "".join(f"| {k} | {v:.1f} | {n} |\n" for k, v, n in p["top_ops_self_ms"])
    return text


def phases(name: str, cfg: dict[str, int], rounds: int, device: str = "cpu", model_name: str = "gpt",
           precision: str = "fp32") -> str:
    """Where a private step's time goes: the non-private torch step and its forward+backward,
    fsdpx's whole private step, ``clip_and_sum`` alone, its stages one after the other
    (:func:`clip_stages`, indented) and the noise alone (drawn and added in place to
    parameter-shaped buffers, as the step does), interleaved in each round; medians, and
    ratios to the non-private step (same-round medians), of wall time, of process CPU time, and
    the minor page faults of each part (fresh host pages it touched)."""
    from privacy.clipping import clip_and_sum
    from privacy.noise import add_gaussian_noise_

    model = build_model(cfg, tied=False, device=device, model=model_name, precision=precision)
    batch = build_batch(cfg, device)
    torch_runner = TorchRunner(build_model(cfg, tied=False, device=device, model=model_name, precision=precision),
                               batch)
    fsdpx_runner = FsdpxRunner(model, batch, "auto")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    numel = sum(p.numel() for p in params.values())
    sums = {k: torch.zeros_like(v) for k, v in params.items()}

    def forward_backward() -> None:
        torch_runner.model.zero_grad(set_to_none=True)
        step_loss(torch_runner.model(batch[0]), batch[1]).mean().backward()

    parts = {"non-private torch step": torch_runner.step, "its forward+backward": forward_backward,
             "fsdpx private step (ghost, donated)": fsdpx_runner.step,
             "clip_and_sum (tape, norms, clipped sums)": lambda: clip_and_sum(model, params, batch, step_loss,
                                                                             clip_norm=CLIP_NORM),
             **clip_stages(model, params, batch),
             f"noise ({numel / 1e6:.1f}M normals)": lambda: add_gaussian_noise_(sums, key=0, step=0, std=1.0)}
    times: dict[str, list[float]] = {k: [] for k in parts}
    cpu: dict[str, list[float]] = {k: [] for k in parts}  # process CPU time: steadier on a loaded machine
    faults: dict[str, list[int]] = {k: [] for k in parts}  # minor page faults: fresh host pages touched
    for i in range(rounds + 1):
        for label, fn in parts.items():
            sync(device)
            t0, c0, f0 = time.perf_counter(), time.process_time(), minor_faults()
            fn()
            sync(device)
            if i:  # round 0 warms up
                times[label].append(time.perf_counter() - t0)
                cpu[label].append(time.process_time() - c0)
                faults[label].append(minor_faults() - f0)
        log(f"[{name}] phases round {i}/{rounds}")
    base, cpu_base = times["non-private torch step"], cpu["non-private torch step"]
    lines = [f"**{name}** phases on {device}, {rounds} interleaved rounds, {torch.get_num_threads()} threads, "
             f"model {model_name}, load {[round(x, 1) for x in loadavg()]}", "",
             "| part | median s | vs non-private step (median of same-round ratios) | median CPU s | "
             "vs non-private step, CPU time | minor page faults (median) |", "|---|---:|---:|---:|---:|---:|"]
    for label, ts in times.items():
        lines.append(f"| {label} | {statistics.median(ts):.3f} | {median_ratio(ts, base):.2f}x | "
                     f"{statistics.median(cpu[label]):.3f} | {median_ratio(cpu[label], cpu_base):.3f}x | "
                     f"{statistics.median(faults[label]):.0f} |")
    noise = f"noise ({numel / 1e6:.1f}M normals)"
    lines.append(f"\nnoise: {statistics.median(times[noise]) / numel * 1e9:.1f} ns per normal (wall, all threads), "
                 f"{statistics.median(cpu[noise]) / numel * 1e9:.1f} (process CPU time)")
    return "\n".join(lines) + "\n"


def clip_stages(model: torch.nn.Module, params: dict[str, torch.Tensor], batch) -> dict[str, Any]:
    """The stages of ``clip_and_sum`` (ghost, one process, no mask) as separate parts, each run
    after the one before it within a round, on what it left: ``--phases`` times them alone. The
    same calls in the same order as ``privacy.clipping.clip_and_sum``; the last forms every
    clipped sum (``ClippedSums`` taken whole)."""
    from privacy import contributions as C
    from privacy.clipped_sums import ClippedSums
    from privacy.clipping import clip_factors, guarded_clip_factors
    from privacy.ghost import contributions
    from privacy.streaming import choose_streamed, stream_clipped_sums
    from privacy.tape import record

    shapes = {n: p.shape for n, p in params.items()}
    st: dict[str, Any] = {}

    def tape() -> None:
        st["tape"] = record(model, params, batch, step_loss)

    def rules() -> None:
        t = st.pop("tape")
        st["losses"], st["parts"] = t.losses, contributions(model, params, t, method="auto")

    def reuse() -> None:
        st["parts"] = C.instantiate_for_reuse(st["parts"], shapes)
        st["streamed"] = choose_streamed(st["parts"], shapes)

    def norms() -> None:
        st["sq"] = sum((C.sq_norms(v, shapes[k]) for k, v in st["parts"].items() if k not in st["streamed"]),
                       torch.zeros_like(st["losses"]))

    def stream() -> None:
        st["sums"], st["sq"] = stream_clipped_sums({k: st["parts"].pop(k) for k in st["streamed"]}, shapes,
                                                   st["sq"], lambda n: clip_factors(n, CLIP_NORM, "flat"))

    def clipped() -> None:
        factors, parts = guarded_clip_factors(st["sq"].sqrt(), st.pop("parts"), CLIP_NORM, "flat", "raise")
        dict(ClippedSums(parts, factors, params, ready=st.pop("sums")).items())
        st.clear()

    return {"  tape: forward + backward to layer outputs": tape, "  ghost rules": rules,
            "  per-example grads kept for reuse": reuse, "  per-example norms (the rest)": norms,
            "  streamed norms and clipped sums (LM head)": stream, "  clipped sums (the rest)": clipped}


def minor_faults() -> int:
    """The process's minor page faults so far: each is a fresh 4 KiB host page touched."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def device_name(device: str) -> str:
    """The device line of the report: on CUDA the card, its memory, the CUDA version and
    whether float32 matrix products may use TF32 (torch's default: no)."""
    if device != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return (f"cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
            f"float32 matmul TF32 {torch.backends.cuda.matmul.allow_tf32}")


def loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def render(report: dict[str, Any]) -> str:
    """The markdown printed at the end of a run, from the raw numbers (also for ``--report``)."""
    env = report["env"]
    text = (f"torch {env['torch']}, Opacus {env['opacus']}, torch.get_num_threads() = {env['threads']}, "
            f"{env['cpus']} CPUs; {env['date']}\n")
    text += f"device: {env.get('device_name', 'cpu')}; model {env.get('model', 'gpt')}, precision {env.get('precision', 'fp32')}\n"
    for name, c in report["configs"].items():
        base = c["timing"].get(BASELINE, {})
        if base.get("times"):
            text += (f"\n{len(base['times'])} timed rounds after {len(base['warmup_times'])} warm-up steps per "
                     "mode, modes interleaved within each round\n")
        text += "\n" + table(name, c["config"], c["timing"], c["memory"], env.get("device", "cpu")) + \
            profile_tables(c["profile"])
    text += (f"\nload average (1, 5, 15 min) at start {[round(x, 1) for x in env['loadavg_start']]}, "
             f"at end {[round(x, 1) for x in env.get('loadavg_end', [])]}\n")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=(*CONFIGS, "both"),
                    help="model and batch (default: small on cpu, gpu on cuda; both = small and large)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", choices=MODELS, default="gpt",
                    help="gpt (fsdpx's), hf-gpt2, hf-llama (transformers, local configs), plain-gpt (plain_gpt.py)")
    ap.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                    help="bf16: every mode's forward under autocast to bf16, parameters and optimizer fp32")
    ap.add_argument("--smoke", action="store_true",
                    help="the smoke config, 1 warm-up step and 1 round, 1 memory step: checks the whole path")
    ap.add_argument("--steps", type=int, default=10, help="timed rounds (each mode one step per round)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per mode (>= 1: the first checks training)")
    ap.add_argument("--modes", nargs="+", choices=MODES,
                    help="default: all; on the models other than gpt, all but fsdpx-ghost-tied")
    ap.add_argument("--out", help="write the raw numbers to this JSON file")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-mode memory subprocesses")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps per memory subprocess")
    ap.add_argument("--profile", action="store_true", help="also profile one step of --profile-modes")
    ap.add_argument("--profile-modes", nargs="+", choices=MODES, default=["torch", "fsdpx-ghost"])
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads(N) (default: leave torch's default)")
    ap.add_argument("--max-step-s", type=float, default=60.0, help="skip a mode whose first step is slower")
    ap.add_argument("--max-mem-gb", type=float,
                    help="skip vmap if per-example grads need more (default 16 on cpu, half the GPU's memory on cuda)")
    ap.add_argument("--report", metavar="FILE.json", help="print the tables of an earlier --out file and exit")
    ap.add_argument("--phases", action="store_true",
                    help="instead of the table: time the private step's parts alone, interleaved")
    ap.add_argument("--memory-mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one memory child
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"opacus\..*")
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.report:
        print(render(json.loads(Path(args.report).read_text())))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    if args.smoke:
        args.config, args.warmup, args.steps, args.memory_steps = "smoke", 1, 1, 1
    args.config = args.config or ("gpu" if args.device == "cuda" else "small")
    args.max_mem_gb = max_mem_gb(args.max_mem_gb, args.device)
    if args.memory_mode:
        print(json.dumps(memory_child(args.memory_mode, args.config, args.memory_steps, args.max_mem_gb,
                                      args.model, args.precision)))
        return
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    names = ["small", "large"] if args.config == "both" else [args.config]
    if args.phases:
        for name in names:
            print(phases(name, CONFIGS[name], args.steps, args.device, args.model, args.precision))
        return
    modes = list(dict.fromkeys(args.modes or default_modes(args.model)))

    import opacus

    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "opacus": opacus.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "loadavg_start": loadavg(), "argv": sys.argv, "device": args.device,
           "device_name": device_name(args.device), "model": args.model, "precision": args.precision}
    log(f"torch {torch.__version__}, opacus {opacus.__version__}, torch.get_num_threads() = "
        f"{torch.get_num_threads()}, load average {env['loadavg_start']}; device: {env['device_name']}")
    report: dict[str, Any] = {"env": env, "configs": {}}
    for name in names:
        cfg = CONFIGS[name]
        timing = time_config(name, cfg, modes, args)
        if args.no_memory:
            memory = {}
        elif args.device == "cuda":
            memory = memory_config_cuda(name, modes, args, timing)
        else:
            memory = memory_config(name, modes, args, timing)
        prof = profile_config(name, cfg, args.profile_modes, args) if args.profile else {}
        report["configs"][name] = {"config": cfg, "timing": timing, "memory": memory, "profile": prof}
    env["loadavg_end"] = loadavg()
    print(render(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        log(f"raw numbers in {args.out}")


if __name__ == "__main__":
    main()
