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
sequential (their losses do not depend on load). Reported per run: the noise multiplier, the
final epsilon, the mean training loss of the last 10 steps, and the held-out loss (mean token
loss on the next ``--corpus-chars // 4`` characters of the corpus) at the last step; then, per
mechanism, the mean over seeds and its ratio to independent noise's.

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
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    log = logger("correlated_noise")
    mechanisms = [("independent", None)] + [("banded", b) for b in args.bands]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        held = Path(tmp) / "held_out.txt"
        held.write_text(corpus(args.corpus_chars + args.corpus_chars // 4)[args.corpus_chars:])
        for seed in args.seeds:
            for kind, bands in mechanisms:
                config = RunConfig.of(**MODEL, steps=args.steps, corpus_chars=args.corpus_chars, lr=args.lr,
                                      batch_size=args.batch_size, target_epsilon=args.epsilon, seed=seed,
                                      noise_mechanism=kind, bands=bands, out=tmp, name=f"{kind}{bands}-{seed}",
                                      export=False, eval_data=str(held), eval_every=args.steps,
                                      accounting_interval=1e-2)
                began = time.perf_counter()
                s = run(config, progress=False)
                row = {"mechanism": kind, "bands": bands, "seed": seed, "noise_multiplier": s["noise_multiplier"],
                       "sample_rate": s["sample_rate"], "epsilon": s["epsilon"], "train_loss": s["final_loss"],
                       "held_out_loss": s["eval_loss"], "seconds": time.perf_counter() - began}
                log(json.dumps(row))
                runs.append(row)
    summary = {}
    for kind, bands in mechanisms:
        mine = [r for r in runs if (r["mechanism"], r["bands"]) == (kind, bands)]
        summary[f"{kind}{'' if bands is None else f' b={bands}'}"] = {
            k: statistics.mean(r[k] for r in mine) for k in ("train_loss", "held_out_loss", "noise_multiplier")}
    base = summary["independent"]
    for v in summary.values():
        v["held_out_vs_independent"] = v["held_out_loss"] / base["held_out_loss"]
    result = {"args": vars(args), "runs": runs, "summary": summary}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
