"""Benchmark: the time one step's noise takes, streamed banded and BLT against independent (issue 32).

    python benchmarks/correlated_noise_cost.py                 # the figures in docs/performance.md

The noise of one private step for every parameter of the tiny GPT of
``benchmarks/correlated_noise.py`` (2 blocks of width 32, 2 heads, 70 tokens: 28 tensors,
28736 elements), on the CPU with one thread: ``privacy.noise.gaussian_noise`` (independent) and
``privacy.mechanisms.streamed_noise`` of the ``--bands`` banded mechanisms optimised for 200
steps, and of BLT mechanisms of ``--buffers`` buffers (decays spread over [0.2, 0.9], scales
``1 / (2 D)``: a step's cost depends on ``D`` only), each at steps ``--at`` (after streaming up
to there, so the history is full). The
configurations are timed in turns, ``--repeats`` rounds of ``--steps`` consecutive steps each,
so load hits them alike; reported per configuration: the median over rounds of the mean time of
a step, and its ratio to independent noise's. A streamed step's cost does not depend on the
step: the ratios at every ``--at`` should agree.

Results go to stdout as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    import torch

    from fsdpx.models.gpt import GPT, GPTConfig
    from privacy.mechanisms import BufferedToeplitz, blt_mechanism, empty_history, optimal_banded, streamed_noise
    from privacy.noise import gaussian_noise

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bands", type=int, nargs="+", default=[4, 16])
    p.add_argument("--buffers", type=int, nargs="*", default=[2, 4])
    p.add_argument("--at", type=int, nargs="+", default=[20, 1000])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=70, block_size=32, n_layer=2, n_head=2, n_embd=32))
    like = {k: torch.zeros_like(v.detach()) for k, v in model.named_parameters()}
    mechanisms = {f"banded b={b}": optimal_banded(b, 200) for b in args.bands}
    for d in args.buffers:
        blt = BufferedToeplitz(tuple(torch.linspace(0.2, 0.9, d).tolist()), (1 / (2 * d),) * d)
        mechanisms[f"blt D={d}"] = blt_mechanism(blt, min_sep=4)
    histories = {}
    for at in args.at:  # stream each mechanism up to step ``at``: a full history
        for b, mech in mechanisms.items():
            history = empty_history(mech)
            for t in range(max(0, at - mech.history_length - 1), at):  # every entry written
                _, history = streamed_noise(mech, like, history, key=1, step=t, std=1.0)
            histories[(b, at)] = history

    def independent(at: int) -> None:
        for t in range(at, at + args.steps):
            gaussian_noise(like, key=1, step=t, std=1.0)

    def correlated(b: str, at: int) -> None:
        history = histories[(b, at)]
        for t in range(at, at + args.steps):
            _, history = streamed_noise(mechanisms[b], like, history, key=1, step=t, std=1.0)

    runs = {f"independent @{at}": (lambda at=at: independent(at)) for at in args.at}
    runs.update({f"{b} @{at}": (lambda b=b, at=at: correlated(b, at)) for b in mechanisms for at in args.at})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            began = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - began) / args.steps)
    summary = {}
    for name, ts in times.items():
        at = name.split("@")[1]
        summary[name] = {"ms_per_step": statistics.median(ts) * 1e3,
                         "vs_independent": statistics.median(ts) / statistics.median(times[f"independent @{at}"])}
    result = {"args": vars(args), "elements": sum(t.numel() for t in like.values()), "tensors": len(like),
              "summary": summary}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
