"""Synthetic planning instances (pure): the benchmark's and ``fsdpx jobs plan --synthetic``'s.

Each job: one-device runtime ``base`` ~ U(100, 1000) s, serial fraction ``s`` ~ U(0.02, 0.3),
and on ``n`` devices ``base * slowdown * (s + (1 - s) / n)`` (Amdahl: diminishing returns).
Memory makes small counts infeasible: the job needs at least ``m`` devices under zero3
(``m`` from {1, 1, 2, 4}), ``m`` under zero2 (10% slower than ddp) and ``2m`` under ddp;
zero3 is 25% slower than ddp. Counts are powers of two up to ``G``, and ``G`` itself.
"""

from __future__ import annotations

import random

from .plan import Option

SLOWDOWN = {"ddp": 1.0, "zero2": 1.1, "zero3": 1.25}
MIN_FACTOR = {"ddp": 2, "zero2": 1, "zero3": 1}


def synthetic_options(jobs: int, cluster_size: int, seed: int = 0) -> dict[str, list[Option]]:
    """``{"job00": [Option, ...], ...}`` for ``jobs`` jobs on ``cluster_size`` devices, a function
    of the arguments only. Every job has at least one option (its smallest count is capped at
    ``cluster_size``)."""
    rng = random.Random(seed)
    counts = sorted({*(2**k for k in range(cluster_size.bit_length()) if 2**k <= cluster_size), cluster_size})
    out = {}
    for j in range(jobs):
        base, serial = rng.uniform(100, 1000), rng.uniform(0.02, 0.3)
        smallest = min(rng.choice((1, 1, 2, 4)), counts[-1])
        opts = [Option(t, n, base * f * (serial + (1 - serial) / n)) for t, f in SLOWDOWN.items()
                for n in counts if n >= min(smallest * MIN_FACTOR[t], counts[-1])]
        out[f"job{j:02d}"] = opts
    return out
