"""Benchmark: banded matrix-factorization noise against independent noise at the same epsilon
(issue 32 items 1-2).

    python benchmarks/correlated_noise.py                  # the figures in docs/performance.md
    python benchmarks/correlated_noise.py --steps 20       # a quick look

Each run is ``fsdpx train``'s loop (``fsdpx.train.run``) on the tiny GPT (2 blocks of width 32,
2 heads, 32 characters per example) over the first ``--corpus-chars`` characters of the embedded
corpus, AdamW, clip norm 1, expected batch ``--batch-size``, ``--steps`` steps (several epochs),
noise calibrated to the same target epsilon at delta 1e-5 by each mechanism's own accounting:
independent noise with Poisson batches, and ``--noise-mechanism banded --bands B`` with cyclic
Poisson batches (``privacy.mechanisms``). Each configuration runs once per seed; runs are
sequential, the mechanisms of a seed one after the other (their losses do not depend on load;
their times do, so they are compared within one invocation). Reported per run: the noise
multiplier, the final epsilon, the mean training loss of the last 10 steps, the held-out loss
(mean token loss on the next ``--corpus-chars // 4`` characters of the corpus) at the last step
and the wall time (``seconds``, the whole run: data, steps, evaluation); then, per mechanism, the
mean over seeds and its ratios to independent noise's (``held_out_vs_independent``,
``seconds_vs_independent``).

``--optimizer sgd``: the same runs with SGD (heavy-ball ``--momentum``, 0 by default) in place of
the loop's AdamW, built from the loop's own pieces (``build_source``, ``resolve_privacy``,
``sampler_of``, ``make_private_step``); without momentum its update is the workload the loop's
banded coefficients are optimised for (prefix sums of the noised gradients). Also reported,
from the accounting alone: ``noise_rmse_vs_independent``, the RMS error of the workload's noise
(``sigma * sqrt(||W C^{-1}||_F^2)``, ``W`` the prefix sums or, with momentum, SGD-with-momentum's
workload) relative to independent noise's at the same epsilon: the benefit the mechanism
promises, before any training.

``--lrs``: a learning-rate grid (in place of ``--lr``); every mechanism runs every rate on
every seed. The summary then holds one entry per mechanism and rate (``"<mechanism> lr=<lr>"``,
ratios against independent noise at the same rate) and ``best``: per mechanism the rate of the
lowest mean held-out loss and its ratio to independent noise's best (the rate tuned per
mechanism, as the papers do; tuned on the reported seeds' held-out loss, so slightly optimistic
for every mechanism alike).

``--coefficients prefix momentum`` (SGD only): besides the prefix-sum coefficients the loop
uses, banded runs with coefficients optimised for the workload of SGD with ``--momentum``
(``privacy.mechanisms.optimize.optimal_banded_for_workload`` on ``momentum_workload``), the
same bands and so the same accounting and noise multiplier; labelled ``banded b=B momentum-opt``.
``noise_rmse_vs_independent`` is then the error of that momentum workload.

``--blt-buffers D ...`` (with ``--min-separation B ...``, 1 by default): BLT (buffered linear
Toeplitz) rows, ``--noise-mechanism blt --buffers D --min-separation B``: the loop's BLT
(``run_mechanism``: optimised for prefix sums at its min-separation sensitivity), cyclic Poisson
batches of ``B`` groups (``B = 1``: plain Poisson), its noise multiplier from its own accounting,
which claims no amplification by sampling (one Gaussian at ``sigma`` over the min-separation
sensitivity, ``privacy.mechanisms.accounting``), so it is conservative; labelled
``blt D=<D> sep=<B>``; ``--bands`` with no value leaves the banded rows out. Its ``noise_rmse_vs_independent`` uses its column ``C`` as it is (first
entry 1, not normalised) with that multiplier. ``--coefficients momentum`` changes banded rows only.

``--plan``: no training; for every mechanism, its noise multiplier, within-group sample rate
and ``noise_rmse_vs_independent`` (both coefficient kinds): the accounting's promise, to pick
the bands and batch sizes worth training.

Results go to stdout as one JSON object; progress to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, when loaded as a module by the tests

from bench_common import logger  # noqa: E402

MODEL = dict(n_layer=2, n_embd=32, n_head=2, block_size=32)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from fsdpx.train import RunConfig, run
    from fsdpx.train.data import corpus

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--corpus-chars", type=int, default=64_000)
    p.add_argument("--batch-size", type=float, default=64.0)
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="a learning-rate grid (replaces --lr)")
    p.add_argument("--bands", type=int, nargs="*", default=[4, 16], help="banded rows (none: --bands alone)")
    p.add_argument("--coefficients", choices=COEFFICIENTS, nargs="+", default=["prefix"],
                   help="banded coefficients: prefix-sum optimised (the loop's) and/or momentum-workload optimised")
    p.add_argument("--blt-buffers", type=int, nargs="+", default=[],
                   help="BLT rows with these buffer counts (--noise-mechanism blt --buffers D)")
    p.add_argument("--min-separation", type=int, nargs="+", default=[1],
                   help="min separations of the BLT rows (cyclic groups; 1: plain Poisson batches)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--plan", action="store_true", help="no training: noise multipliers and noise RMSE ratios only")
    p.add_argument("--reverse", action="store_true",
                   help="run each seed's mechanisms in reverse order (banded first): the order's share of the times")
    args = p.parse_args(argv)
    if args.optimizer == "adamw" and args.coefficients != ["prefix"]:
        p.error("--coefficients momentum needs --optimizer sgd (the loop's AdamW runs the prefix-sum coefficients)")
    torch.set_num_threads(1)
    log = logger("correlated_noise")
    lrs = args.lrs or [args.lr]
    mechanisms = ([Mech("independent", None, "prefix")] + [Mech("banded", b, c) for b in args.bands for c in args.coefficients]
                  + [Mech("blt", None, "prefix", d, sep) for d in args.blt_buffers for sep in args.min_separation])
    privacy = {}  # Mech -> DPConfig: calibrated and optimised once, not per run
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        held = Path(tmp) / "held_out.txt"
        held.write_text(corpus(args.corpus_chars + args.corpus_chars // 4)[args.corpus_chars:])
        for seed in args.seeds[:1] if args.plan else args.seeds:
            for lr in lrs[:1] if args.plan else lrs:
                for m in (mechanisms[::-1] if args.reverse else mechanisms):
                    kind, bands, coef = m.kind, m.bands, m.coefficients
                    config = RunConfig.of(**MODEL, steps=args.steps, corpus_chars=args.corpus_chars, lr=lr,
                                          batch_size=args.batch_size, target_epsilon=args.epsilon, seed=seed,
                                          noise_mechanism=kind, bands=bands, buffers=m.buffers,
                                          min_separation=m.min_separation, out=tmp,
                                          name=run_name(m, lr, seed), export=False,
                                          eval_data=str(held), eval_every=args.steps, accounting_interval=1e-2)
                    if args.plan:
                        dp = privacy.setdefault(m, run_privacy(config, coef, args.momentum))
                        runs.append(plan_row(m, dp))
                        log(json.dumps(runs[-1]))
                        continue
                    began = time.perf_counter()
                    if args.optimizer == "adamw":
                        s = run(config, progress=False)
                    else:
                        dp = privacy.setdefault(m, run_privacy(config, coef, args.momentum))
                        s = sgd_run(config, args, held, dp, lr)
                    row = {**fields_of(m), "lr": lr, "seed": seed,
                           "noise_multiplier": s["noise_multiplier"], "sample_rate": s["sample_rate"],
                           "epsilon": s["epsilon"], "train_loss": s["final_loss"], "held_out_loss": s["eval_loss"],
                           "seconds": time.perf_counter() - began}
                    log(json.dumps(row))
                    runs.append(row)
    if args.plan:
        result = {"args": vars(args), "plan": [dict(r, noise_rmse_vs_independent=noise_rmse(r, runs[0], args))
                                               for r in runs]}
        print(json.dumps(result, indent=1))
        return result
    summary = {}
    for lr in lrs:
        base = mean_of(runs, mechanisms[0], lr)
        for m in mechanisms:
            v = mean_of(runs, m, lr)
            v["held_out_vs_independent"] = v["held_out_loss"] / base["held_out_loss"]
            v["seconds_vs_independent"] = v["seconds"] / base["seconds"]
            v["noise_rmse_vs_independent"] = noise_rmse(v, base, args)
            v["per_seed_held_out_vs_independent"] = per_seed_ratios(runs, m, lr)
            summary[label(m) + ("" if len(lrs) == 1 else f" lr={lr}")] = v
    result = {"args": vars(args), "runs": runs, "summary": summary}
    if len(lrs) > 1:
        result["best"] = best_rates(runs, mechanisms, lrs)
    print(json.dumps(result, indent=1))
    return result


COEFFICIENTS = ("prefix", "momentum")


class Mech(NamedTuple):
    """One mechanism row: ``kind`` with its ``bands`` (banded), ``coefficients`` ("prefix" or
    "momentum", banded only) or ``buffers`` and ``min_separation`` (blt)."""

    kind: str
    bands: int | None
    coefficients: str
    buffers: int | None = None
    min_separation: int | None = None


def fields_of(m: Mech) -> dict:
    """A row's mechanism fields: ``mechanism``, ``bands``, ``coefficients``, and for a BLT
    ``buffers`` and ``min_separation``."""
    blt = {"buffers": m.buffers, "min_separation": m.min_separation} if m.kind == "blt" else {}
    return {"mechanism": m.kind, "bands": m.bands, "coefficients": m.coefficients, **blt}


def run_name(m: Mech, lr: float, seed: int) -> str:
    """A run directory's name, distinct for every mechanism, rate and seed of an invocation (the
    loop refuses to overwrite a run)."""
    return "-".join([m.kind, *(f"{k}{v}" for k, v in zip(("b", "c", "d", "sep"), m[1:]) if v is not None),
                     f"lr{lr:g}", f"s{seed}"])


def mech_of(row: dict) -> Mech:
    """The mechanism of a run or plan row (the inverse of :func:`fields_of`)."""
    return Mech(row["mechanism"], row["bands"], row["coefficients"], row.get("buffers"), row.get("min_separation"))


def label(m: Mech) -> str:
    """The summary's name of a mechanism: ``independent``, ``banded b=4``, ``banded b=4 momentum-opt``,
    ``blt D=2 sep=1``."""
    if m.kind == "blt":
        return f"blt D={m.buffers} sep={m.min_separation}"
    return m.kind + ("" if m.bands is None else f" b={m.bands}") + (" momentum-opt" if m.coefficients == "momentum"
                                                                    else "")


def mean_of(runs: list[dict], m: Mech, lr: float) -> dict:
    """The means over seeds of one mechanism's runs at ``lr`` (with its fields kept for
    :func:`noise_rmse`)."""
    mine = [r for r in runs if mech_of(r) == m and r["lr"] == lr]
    v = {k: statistics.mean(r[k] for r in mine) for k in ("train_loss", "held_out_loss", "noise_multiplier", "seconds")}
    return dict(v, **fields_of(m), lr=lr, seeds=len(mine))


def per_seed_ratios(runs: list[dict], m: Mech, lr: float) -> dict:
    """Seed -> held-out loss over independent noise's at the same seed and ``lr``."""
    held = {(mech_of(r), r["seed"]): r["held_out_loss"] for r in runs if r["lr"] == lr}
    base = Mech("independent", None, "prefix")
    return {seed: held[(k, seed)] / held[(base, seed)] for (k, seed) in held if k == m}


def best_rates(runs: list[dict], mechanisms: list[Mech], lrs: list[float]) -> dict:
    """Per mechanism: the rate of the lowest mean held-out loss, that loss, its ratio to
    independent noise's best, and the per-seed losses at that rate."""
    best = {}
    for m in mechanisms:
        means = {lr: mean_of(runs, m, lr)["held_out_loss"] for lr in lrs}
        lr = min(means, key=means.get)
        best[label(m)] = {"lr": lr, "held_out_loss": means[lr], "per_lr": means,
                          "per_seed": {r["seed"]: r["held_out_loss"] for r in runs
                                       if mech_of(r) == m and r["lr"] == lr}}
    base = best["independent"]["held_out_loss"]
    for v in best.values():
        v["held_out_vs_independent_best"] = v["held_out_loss"] / base
    return best


def run_privacy(config, coefficients: str, momentum: float):
    """The run's ``DPConfig`` (``resolve_privacy``: the loop's calibration), its banded mechanism
    replaced by the momentum-workload optimum when ``coefficients == "momentum"`` (same bands, so
    the same accounting and noise multiplier)."""
    import dataclasses

    from fsdpx.train.build import resolve_privacy, resolve_sample_rate
    from fsdpx.train.sources import build_source
    from privacy.mechanisms.optimize import momentum_workload, optimal_banded_for_workload

    n = int(build_source(config).inputs.shape[0])
    dp = resolve_privacy(config, resolve_sample_rate(config, n))
    if coefficients == "momentum" and dp.mechanism.kind == "banded":
        mechanism = optimal_banded_for_workload(dp.mechanism.bands, momentum_workload(config.run.steps, momentum))
        dp = dataclasses.replace(dp, mechanism=mechanism)
    return dp


def plan_row(m: Mech, dp) -> dict:
    """One mechanism's accounting, for ``--plan`` (a BLT's strategy: its decays and scales)."""
    strategy = ({"decays": list(dp.mechanism.decays), "scales": list(dp.mechanism.scales)} if m.kind == "blt"
                else list(dp.mechanism.coefficients))
    return {**fields_of(m), "noise_multiplier": dp.noise_multiplier, "sample_rate": dp.sample_rate,
            "strategy": strategy}


def noise_rmse(row: dict, base: dict, args) -> float:
    """The RMS error of the workload's noise (prefix sums, or SGD with ``args.momentum``) of
    ``row``'s mechanism relative to ``base``'s (independent noise) at the same epsilon:
    ``sigma * sqrt(||W C^{-1}||_F^2)`` over the same for ``base``."""
    m = mech_of(row)
    return (row["noise_multiplier"] / base["noise_multiplier"]
            * (workload_error_of(m, args.steps, args.momentum)
               / workload_error_of(Mech("independent", None, "prefix"), args.steps, args.momentum)) ** 0.5)


@functools.lru_cache(maxsize=None)
def workload_error_of(m: Mech, steps: int, momentum: float) -> float:
    """``||W C^{-1}||_F^2`` of the mechanism for SGD's workload with ``momentum`` (0: prefix
    sums; independent noise: ``||W||_F^2``). Banded ``C`` has unit columns; a BLT's ``C`` is
    taken as the step streams it (first entry 1), the scale its noise multiplier is calibrated
    for: ``workload_error`` normalises the column, so its squared norm is divided back out."""
    import torch

    from fsdpx.train.build import optimal_blt_mechanism
    from privacy.mechanisms import optimal_banded
    from privacy.mechanisms.blt import strategy_of
    from privacy.mechanisms.optimize import momentum_workload, optimal_banded_for_workload, workload_error

    w = momentum_workload(steps, momentum)
    if m.kind == "blt":
        column = strategy_of(optimal_blt_mechanism(m.buffers, steps, m.min_separation)).coefficients(steps)
        return (workload_error(column, w) / (column * column).sum()).item()
    mechanism = (optimal_banded_for_workload(m.bands or 1, w) if m.coefficients == "momentum"
                 else optimal_banded(m.bands or 1, steps))
    return workload_error(torch.tensor(mechanism.coefficients), w).item()


def sgd_run(config, args, held: Path, dp, lr: float) -> dict:
    """The loop's private run with SGD (``lr``, ``args.momentum``) and privacy ``dp``
    (:func:`run_privacy`): the summary keys ``main`` reads."""
    import torch
    from torch.func import functional_call

    from fsdpx.optim import sgd
    from fsdpx.train.build import resolve_sample_rate, sampler_of
    from fsdpx.train.data import make_examples
    from fsdpx.train.sources import build_source
    from privacy.accounting import Accountant
    from privacy.step import init_state, make_private_step, sample_batch

    source = build_source(config)
    n = int(source.inputs.shape[0])
    rate = resolve_sample_rate(config, n)
    assert rate == dp.sample_rate, (rate, dp.sample_rate)
    opt = sgd(lr, args.momentum)
    state = init_state(source.params, opt, key=config.run.seed, config=dp)
    state = state._replace(accountant=Accountant(delta=dp.delta, value_discretization_interval=1e-2,
                                                 **dp.mechanism.ledger_fields))
    step = make_private_step(source.model, source.loss_fn, opt, dp, num_examples=n // config.privacy.groups)
    sampler, losses = sampler_of(config, n, rate), []
    for t in range(config.run.steps):
        state, metrics = step(state, sample_batch((source.inputs, source.targets), sampler, t))
        losses.append(metrics["loss"])
    x, y = make_examples(held.read_text(), config.data.block_size)
    with torch.no_grad():
        held_loss = float(source.loss_fn(functional_call(source.model, state.params, (x,)), y).mean())
    return {"noise_multiplier": dp.noise_multiplier, "sample_rate": rate, "epsilon": state.accountant.epsilon(),
            "final_loss": sum(losses[-10:]) / len(losses[-10:]), "eval_loss": held_loss}

if __name__ == "__main__":
    main()
