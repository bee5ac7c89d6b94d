"""Benchmark: ``--precision bf16`` against fp32 on the tiny GPT (issue 29 item 3).

    python benchmarks/precision.py                 # 100 steps, the figures in docs/performance.md
    python benchmarks/precision.py --steps 5       # a quick look

Both runs are built as ``fsdpx train`` builds them (``build_source``, ``resolve_privacy``,
``build_step``: private, ghost clipping, AdamW, target epsilon 8) from one configuration that
differs only in ``precision``, on the same initial weights, and take the same Poisson batches
with the same noise bits: at each step the fp32 run steps, then the bf16 run, on one batch, so
load from other processes hits both alike. Reported:

  loss          the mean training loss of the last 10 steps of each run, and their relative
                difference (target: within 2%); also each trained model's fp32 loss on one fixed
                batch of 256 examples
  norm error    per-example gradient norms of the bf16 forward against the fp32 forward, same
                parameters and batch (the initial ones, and the fp32 run's final ones): max and
                median relative difference over the examples
  step time     median over steps of the bf16 / fp32 ratio of same-step wall seconds and of
                process CPU seconds (the steadier figure on a shared machine)

Results go to stdout as one JSON object; progress to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import clocks, logger  # noqa: E402

MODEL = dict(n_layer=2, n_embd=32, n_head=2, block_size=32)
"""The tiny GPT: 2 blocks of width 32 on the embedded corpus, 32 characters per example."""


def main(argv: list[str] | None = None) -> dict:
    import torch

    from fsdpx.train import RunConfig
    from fsdpx.train.build import build_step, resolve_privacy, resolve_sample_rate
    from fsdpx.train.sources import build_source
    from privacy.clipping import per_sample_norms
    from privacy.precision import compute_in
    from privacy.sampling import PoissonSampler
    from privacy.step import sample_batch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=float, default=64.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = logger("precision")

    base = RunConfig.of(steps=args.steps, batch_size=args.batch_size, **MODEL)
    source = build_source(base)
    data = (source.inputs, source.targets)
    rate = resolve_sample_rate(base, len(source.inputs))
    dp = resolve_privacy(base, rate)
    runs = {}
    for precision in ("fp32", "bf16"):
        config = base.replace(precision=precision)
        model = copy.deepcopy(source.model)
        state, step = build_step(config, model, source.params, dp, num_examples=len(source.inputs),
                                 loss_fn=source.loss_fn)
        runs[precision] = {"model": model, "state": state, "step": step, "losses": [], "wall": [], "cpu": []}
    sampler = PoissonSampler(len(source.inputs), rate, key=base.run.seed)
    for t in range(args.steps):
        batch = sample_batch(data, sampler, t)
        for run in runs.values():
            wall, cpu = clocks()
            run["state"], metrics = run["step"](run["state"], batch)
            wall2, cpu2 = clocks()
            run["losses"].append(metrics["loss"])
            run["wall"].append(wall2 - wall)
            run["cpu"].append(cpu2 - cpu)
        if t % 10 == 0 or t == args.steps - 1:
            log(f"step {t + 1}: loss fp32 {runs['fp32']['losses'][-1]:.4f} bf16 {runs['bf16']['losses'][-1]:.4f}")

    last = {k: statistics.fmean(r["losses"][-10:]) for k, r in runs.items()}
    fixed = sample_batch(data, PoissonSampler(len(source.inputs), min(1.0, 256 / len(source.inputs)), key=12345), 0)
    eval_model = copy.deepcopy(source.model)
    fixed_loss = {}
    for k, r in runs.items():
        with torch.no_grad():
            out = torch.func.functional_call(eval_model, r["state"].params, (fixed[0],))
            fixed_loss[k] = float(source.loss_fn(out, fixed[1]).mean())

    bf16_model = compute_in(copy.deepcopy(source.model), "bf16")
    norm_error = {}
    for label, params in (("initial", source.params), ("trained", runs["fp32"]["state"].params)):
        batch = sample_batch(data, sampler, args.steps)
        n32 = per_sample_norms(eval_model, params, batch, source.loss_fn)
        n16 = per_sample_norms(bf16_model, params, batch, source.loss_fn)
        rel = ((n16.double() - n32.double()).abs() / n32.double()).tolist()
        norm_error[label] = {"examples": len(rel), "max": max(rel), "median": statistics.median(rel)}

    def ratio(key: str) -> float:
        return statistics.median(b / a for a, b in zip(runs["fp32"][key][1:], runs["bf16"][key][1:]))

    result = {
        "model": MODEL, "steps": args.steps, "expected_batch": args.batch_size, "examples": len(source.inputs),
        "noise_multiplier": dp.noise_multiplier,
        "loss_last10": last, "loss_relative_difference": abs(last["bf16"] - last["fp32"]) / last["fp32"],
        "loss_fixed_batch": fixed_loss,
        "norm_relative_error": norm_error,
        "step_seconds_median": {k: statistics.median(r["wall"][1:]) for k, r in runs.items()},
        "step_time_ratio_bf16_over_fp32": {"wall": ratio("wall"), "cpu": ratio("cpu")},
        "finite": all(math.isfinite(x) for r in runs.values() for x in r["losses"]),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
