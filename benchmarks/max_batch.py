"""The largest private batch per rank under a fixed memory cap: private DDP vs private ZeRO-3
(issue 14 section 3, the seeds' headline: Opacus reports 2.6x for its FSDP over its DDP).

    .venv/bin/python benchmarks/max_batch.py [--small] [--cap-mib 2560] [--seq 128] [--out r.json]

Setting: transformers' ``GPT2LMHeadModel`` built from a local config (12 layers, width 768,
12 heads, vocabulary 50257, tied ``wte``/``lm_head``: GPT-2 small, 124M parameters), unmodified,
trained with DP-SGD (ghost clipping, flat clip 1, noise 1) and fsdpx's AdamW on 4 gloo processes
(torchrun, one thread each), one mode per torchrun launch:

* ``ddp``    ``make_sharded_step(..., strategies.ddp())``
* ``zero3``  ``make_sharded_step(..., strategies.zero3())``
* ``zero3-zenflow``  ZeRO-3 with ZenFlow's selective update (``fsdpx.train.loop.make_optimizer``
  with ``offload="zenflow"``). On a CPU the "host" is the same memory as the "device": RSS
  cannot show what ZenFlow moves off a GPU, so this row reports what the process holds.

Peak memory per rank, measured: ``VmRSS`` after the imports and the process group are set up is
the baseline; the model is built, the sharded state cut from it and the module's own parameters
released; ``VmHWM`` is then reset (``/proc/self/clear_refs``) and ``--steps`` real private steps
run on a global batch of ``world x b`` sequences. The peak is ``VmHWM - baseline``, the largest
over the ranks, with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps freed heap pages
resident and hides what a runtime frees, docs/performance.md). A probe FITS when that peak is at
most the cap. A watchdog thread polls ``VmRSS`` every 5 ms and ends a probe as soon as one rank
is above the cap (that rank's peak is then above the cap too, so the verdict is the same; it only
saves the rest of a doomed step and keeps 4 oversized processes off a shared machine).

Search (``max_fitting``): doubling from 1 until a batch does not fit, then bisection between the
last fit and the first miss; every probe is a fresh torchrun launch.

Prediction, beside each measurement (``fsdpx.runtime.step_memory.private_step_peak``): the cost
model's resident state (``memory_by_rank``: parameters, reduced gradients, 2 AdamW moments), the
raw gradient the backward produces in the compute layout, the largest gathered unit
(``peak_gathered_bytes``), and the activations, output gradients and per-example factors of the
ghost-clipping step for ``b`` examples, counted by running that step's tape on ``meta`` tensors
with a live-bytes tracker (no data, no time).

Opacus 1.6 (``ghost`` with DDP, ``ghost_fsdp`` with FSDP2) is tried on the same model; when it
refuses, the exception is printed.
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
from bench_common import launch_worker, reset_hwm, status_kb  # noqa: E402

MODES = ["ddp", "zero3", "zero3-zenflow"]
FULL = dict(vocab_size=50257, n_layer=12, n_embd=768, n_head=12)
SMALL = dict(vocab_size=2048, n_layer=2, n_embd=128, n_head=4)
CLIP, SIGMA, NUM_EXAMPLES = 1.0, 1.0, 100_000
MIB = 2 ** 20
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def log(msg: str) -> None:
    print(f"[max_batch {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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

def gpt2_config(size: dict, seq: int):
    import transformers

    return transformers.GPT2Config(vocab_size=size["vocab_size"], n_positions=seq, n_embd=size["n_embd"],
                                   n_layer=size["n_layer"], n_head=size["n_head"], resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, use_cache=False,
                                   bos_token_id=0, eos_token_id=0)


def build_model(size: dict, seq: int, device: str = "cpu"):
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(gpt2_config(size, seq))
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as GPT-2 ships
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
    from fsdpx.train.loop import RunConfig, make_optimizer as job_optimizer

    return job_optimizer(RunConfig(strategy="zero3", offload="zenflow", lr=1e-4), comm)


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


def run_setup(mode: str, comm, size: dict, seq: int, global_batch: int):
    """``(step, state, model)`` of ``mode`` for the GPT-2 of ``size`` (full parameters built
    here; the caller releases the module's own)."""
    from fsdpx import init_sharded, make_sharded_step, strategies

    model = build_model(size, seq)
    params = {k: v.detach() for k, v in model.named_parameters()}  # tied: one entry
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    strategy = strategies.ALL["zero3" if mode.startswith("zero3") else mode]()
    config = dp_config(global_batch)
    opt = make_optimizer(mode, comm)
    step = make_sharded_step(model, lm_loss, opt, strategy, comm, param_shapes=shapes, config=config,
                             num_examples=NUM_EXAMPLES, donate=True)
    return step, init_sharded(params, opt, strategy, comm, key=0, config=config), model


def warm_up(mode: str, comm, seq: int) -> None:
    """One private step of a tiny GPT-2 in ``mode``, everything dropped after: what a process
    loads once (modules, compiled kernels, thread pools, gloo's buffers) is then resident before
    the baseline is read, so the peak above it is the benchmark model's step."""
    import torch

    world = comm.mesh.size
    step, state, _ = run_setup(mode, comm, SMALL, seq, world)
    tokens = torch.zeros(world, seq, dtype=torch.long)
    step(state, (tokens, tokens))


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fsdpx.runtime.dist_comm import init_from_env
    from fsdpx.sharding import Mesh

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    comm = init_from_env(Mesh(dp=world), timeout_s=1800.0)
    rank = comm.rank
    size = SMALL if args.small else FULL
    b, seq = args.batch, args.seq
    global_batch = world * b
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab_size"], (global_batch, seq), generator=g)
    warm_up(args.mode, comm, seq)  # imports, compiled kernels, thread pools: before the baseline
    gc.collect()
    baseline = status_kb("VmRSS")

    step, state, model = run_setup(args.mode, comm, size, seq, global_batch)
    gc.collect()
    for p in model.parameters():  # the step reads only the sharded state
        p.untyped_storage().resize_(0)
    setup_kb = status_kb("VmRSS") - baseline
    reset = reset_hwm()
    if not reset:
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would include set-up")
    dog = Watchdog(baseline, args.cap_mib * 1024, args.over, rank)
    dog.thread.start()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, (tokens, tokens))
        losses.append(metrics["loss"])
    seconds = time.perf_counter() - t0
    dog.stop.set()
    dog.thread.join()
    result = {"rank": rank, "baseline_kb": baseline, "setup_kb": setup_kb,
              "peak_kb": status_kb("VmHWM") - baseline, "resident_bytes": metrics["resident_bytes"],
              "losses": losses, "seconds": seconds}
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
                 *(["--small"] if args.small else [])]
        t0 = time.perf_counter()
        try:
            job = launch_worker(os.path.abspath(__file__), wargs, MALLOC_ENV, args.nproc, log)
        except (subprocess.CalledProcessError, OSError, ValueError) as e:
            marks = [json.load(open(os.path.join(tmp, f))) for f in os.listdir(tmp) if f.startswith("over.")]
            if not marks:
                raise RuntimeError(f"probe {mode} b={b} failed without passing the cap: {e}") from e
            worst = max(m["rss_above_baseline_kb"] for m in marks)
            return {"batch": b, "fits": False, "cut_short": True, "peak_mib": None,
                    "over_mib": worst / 1024, "wall_s": time.perf_counter() - t0}
    peaks = [r["peak_kb"] / 1024 for r in job["ranks"]]
    return {"batch": b, "fits": max(peaks) <= args.cap_mib, "cut_short": False, "peak_mib": max(peaks),
            "peak_mib_by_rank": peaks, "setup_mib": max(r["setup_kb"] for r in job["ranks"]) / 1024,
            "resident_bytes": [r["resident_bytes"] for r in job["ranks"]],
            "loss": job["ranks"][0]["losses"][-1], "wall_s": time.perf_counter() - t0}


def predicted_mib(mode: str, b: int, args) -> dict[str, float] | None:
    """``fsdpx.runtime.step_memory.step_peak`` of ``mode`` at ``b`` per rank, in MiB; ``None``
    for ZenFlow, whose optimizer copies its state to the host at init, which ``meta`` tensors
    cannot do."""
    if mode == "zero3-zenflow":
        return None
    from fsdpx.runtime.step_memory import step_peak
    from fsdpx.sharding import Mesh, strategies

    size = SMALL if args.small else FULL
    model = build_model(size, args.seq, device="meta")
    strategy = strategies.ALL["zero3" if mode.startswith("zero3") else mode]()
    global_batch = args.nproc * b
    mesh = Mesh(dp=args.nproc)
    opt = make_optimizer(mode, _MetaGroup(mesh))
    peak = step_peak(model, lm_loss, opt, strategy, mesh, (global_batch, args.seq),
                     config=dp_config(global_batch), num_examples=NUM_EXAMPLES)
    return {k: v / MIB for k, v in peak._asdict().items()}


class _MetaGroup:
    """A stand-in communicator for building the optimizer of a prediction (ZenFlow's score
    all-reduce is never called on the meta step's first update... if it is, it answers zeros)."""

    def __init__(self, mesh):
        self.mesh, self.rank = mesh, 0

    def run(self, c, x):
        import torch

        return torch.zeros_like(x)


def search(mode: str, args) -> dict:
    probes: list[dict] = []

    def fits(b: int) -> bool:
        rec = probe(mode, b, args)
        probes.append(rec)
        shown = f"peak {rec['peak_mib']:.0f} MiB" if rec["peak_mib"] is not None else \
            f"cut short at {rec['over_mib']:.0f} MiB"
        log(f"{mode} b={b}: {'fits' if rec['fits'] else 'over'} ({shown}, cap {args.cap_mib} MiB, "
            f"{rec['wall_s']:.0f}s)")
        return rec["fits"]

    model_mode = "zero3" if mode == "zero3-zenflow" else mode  # ZenFlow: ZeRO-3's prediction as the start
    guess, _ = max_fitting(lambda b: predicted_mib(model_mode, b, args)["total"] <= args.cap_mib, limit=args.limit)
    log(f"{mode}: the memory model ({model_mode}) puts the largest batch under the cap at {guess}; searching from there")
    best, _ = max_fitting(fits, guess=max(guess, 1), limit=args.limit)
    at = next((p for p in probes if p["batch"] == best), None)
    out = {"mode": mode, "max_batch": best, "predicted_max_batch": guess, "probes": probes, "at_max": at}
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


def table(res: dict) -> str:
    a = res["args"]
    lines = [f"GPT-2 small shape ({'SMALL smoke config' if a['small'] else '12 layers, d 768, vocab 50257'}, "
             f"tied embeddings), seq {a['seq']}, private (ghost clipping), AdamW, {a['nproc']} gloo processes, "
             f"cap {a['cap_mib']} MiB per rank (peak VmHWM above the post-import baseline, "
             f"MALLOC_MMAP_THRESHOLD_=65536), {a['steps']} step(s) per probe:", "",
             "| mode | max batch per rank | vs ddp | measured peak at max (MiB) | predicted (MiB) | pred/meas "
             "| first miss: measured / predicted (MiB) | probes |",
             "|---|---|---|---|---|---|---|---|"]
    ddp = res["modes"].get("ddp", {}).get("max_batch")
    for mode, r in res["modes"].items():
        at, pred = r.get("at_max"), r.get("predicted")
        meas = at["peak_mib"] if at else None
        ptot = pred["total"] if pred else None
        ratio = f"{r['max_batch'] / ddp:.2f}x" if ddp else "-"
        miss = next((p for p in r["probes"] if not p["fits"] and p["batch"] == min(
            q["batch"] for q in r["probes"] if not q["fits"])), None)
        miss_cell = "-"
        if miss:
            m = f"{miss['peak_mib']:.0f}" if miss["peak_mib"] is not None else f">{miss['over_mib']:.0f} (cut)"
            pm = r.get("predicted_first_miss")
            miss_cell = f"b={miss['batch']}: {m} / {pm['total']:.0f}" if pm else f"b={miss['batch']}: {m} / -"
        probes = " ".join(str(p["batch"]) + ("+" if p["fits"] else "-") for p in r["probes"])
        lines.append(f"| {mode} | {r['max_batch']} | {ratio} | {meas:.0f} | {ptot:.0f} | {ptot / meas:.3f} | "
                     f"{miss_cell} | {probes} |" if meas and ptot else
                     f"| {mode} | {r['max_batch']} | {ratio} | {f'{meas:.0f}' if meas else '-'} | - | - | {miss_cell} "
                     f"| {probes} |")
    lines += ["", "Probes: batch per rank, + fits, - over the cap (in order; the search starts at the memory "
              "model's largest batch under the cap). zero3-zenflow has no prediction (its optimizer copies state "
              "to the host at init, which meta tensors cannot do); on a CPU its host state is the same RSS.",
              "", "Predicted parts at the max batch (MiB): " + "; ".join(
        f"{m}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["predicted"].items())
        for m, r in res["modes"].items() if r.get("predicted"))]
    if res.get("opacus"):
        lines += ["", "Opacus 1.6 on the same model: " + "; ".join(f"{k}: {v}" for k, v in res["opacus"].items())]
    return "\n".join(lines)


def driver(args) -> None:
    res: dict[str, Any] = {"args": vars(args), "load_start": os.getloadavg(), "modes": {}}
    t0 = time.perf_counter()
    for mode in args.modes.split(","):
        log(f"searching {mode}")
        res["modes"][mode] = search(mode, args)
        log(f"{mode}: max batch per rank {res['modes'][mode]['max_batch']}")
    if not args.skip_opacus:
        res["opacus"] = opacus_check(args)
    res["wall_s"] = time.perf_counter() - t0
    res["load_end"] = os.getloadavg()
    text = table(res)
    print(text)
    log(f"done in {res['wall_s']:.0f}s; load {res['load_start'][0]:.1f} -> {res['load_end'][0]:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**res, "table": text}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny GPT-2 and a small cap, to check the script")
    ap.add_argument("--modes", default=",".join(MODES))
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
