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

``--optimizer sgd``: the same runs with SGD (``--momentum``) in place of the loop's AdamW, the
workload the banded coefficients are optimised for (prefix sums of the noised gradients), built
from the loop's own pieces (``build_source``, ``resolve_privacy``, ``sampler_of``,
``make_private_step``). Also reported, from the accounting alone: ``noise_rmse_vs_independent``,
the RMS error of the prefix sums (``sigma * sqrt(||A C^{-1}||_F^2)``) relative to independent
noise's at the same epsilon: the benefit the mechanism promises for SGD, before any training.

Results go to stdout as one JSON object; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    p.add_argument("--bands", type=int, nargs="+", default=[4, 16])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--reverse", action="store_true",
                   help="run each seed's mechanisms in reverse order (banded first): the order's share of the times")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    log = logger("correlated_noise")
    mechanisms = [("independent", None)] + [("banded", b) for b in args.bands]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        held = Path(tmp) / "held_out.txt"
        held.write_text(corpus(args.corpus_chars + args.corpus_chars // 4)[args.corpus_chars:])
        for seed in args.seeds:
            for kind, bands in (mechanisms[::-1] if args.reverse else mechanisms):
                config = RunConfig.of(**MODEL, steps=args.steps, corpus_chars=args.corpus_chars, lr=args.lr,
                                      batch_size=args.batch_size, target_epsilon=args.epsilon, seed=seed,
                                      noise_mechanism=kind, bands=bands, out=tmp, name=f"{kind}{bands}-{seed}",
                                      export=False, eval_data=str(held), eval_every=args.steps,
                                      accounting_interval=1e-2)
                began = time.perf_counter()
                s = run(config, progress=False) if args.optimizer == "adamw" else sgd_run(config, args, held)
                row = {"mechanism": kind, "bands": bands, "seed": seed, "noise_multiplier": s["noise_multiplier"],
                       "sample_rate": s["sample_rate"], "epsilon": s["epsilon"], "train_loss": s["final_loss"],
                       "held_out_loss": s["eval_loss"], "seconds": time.perf_counter() - began}
                log(json.dumps(row))
                runs.append(row)
    summary = {}
    for kind, bands in mechanisms:
        mine = [r for r in runs if (r["mechanism"], r["bands"]) == (kind, bands)]
        summary[f"{kind}{'' if bands is None else f' b={bands}'}"] = {
            k: statistics.mean(r[k] for r in mine) for k in ("train_loss", "held_out_loss", "noise_multiplier",
                                                            "seconds")}
    base = summary["independent"]
    for (kind, bands), v in zip(mechanisms, summary.values()):
        v["held_out_vs_independent"] = v["held_out_loss"] / base["held_out_loss"]
        v["seconds_vs_independent"] = v["seconds"] / base["seconds"]
        v["noise_rmse_vs_independent"] = (v["noise_multiplier"] / base["noise_multiplier"]
                                          * (prefix_error(bands, args.steps) / prefix_error(None, args.steps)) ** 0.5)
    result = {"args": vars(args), "runs": runs, "summary": summary}
    print(json.dumps(result, indent=1))
    return result


def prefix_error(bands: int | None, steps: int) -> float:
    """``||A C^{-1}||_F^2`` of the run's mechanism (independent: ``n (n + 1) / 2``)."""
    import torch

    from privacy.mechanisms import optimal_banded, prefix_sum_error

    return prefix_sum_error(torch.tensor(optimal_banded(bands or 1, steps).coefficients), steps).item()


def sgd_run(config, args, held: Path) -> dict:
    """The loop's private run with SGD: the summary keys ``main`` reads."""
    import torch
    from torch.func import functional_call

    from fsdpx.optim import sgd
    from fsdpx.train.build import resolve_privacy, resolve_sample_rate, sampler_of
    from fsdpx.train.data import make_examples
    from fsdpx.train.sources import build_source
    from privacy.accounting import Accountant
    from privacy.step import init_state, make_private_step, sample_batch

    source = build_source(config)
    n = int(source.inputs.shape[0])
    rate = resolve_sample_rate(config, n)
    dp = resolve_privacy(config, rate)
    opt = sgd(args.lr, args.momentum)
    state = init_state(source.params, opt, key=config.run.seed, config=dp)
    state = state._replace(accountant=Accountant(delta=dp.delta, value_discretization_interval=1e-2,
                                                 bands=dp.mechanism.bands))
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
