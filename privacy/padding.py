"""Fixed-shape Poisson batches: the sampled batch padded to ``max_batch_size`` with masked rows.

A Poisson batch has a random size, so every step has a new shape (a new allocation pattern, a
new compiled graph, a ragged split over ranks). Here it is padded to one size with rows that
carry ``mask = False``; every private and plain step reads the mask (``privacy.batch``) and a
masked row contributes exactly zero to the clipped sum, the loss and the norm statistics, while
the private divisor stays ``q N``. So a padded step computes what the unpadded step computes
(``property_tests/test_padded_batch_properties.py``), at one shape for the whole run.

Overflow (the sampled batch is larger than ``max_batch_size``) raises
:class:`BatchOverflowError`; the batch is never truncated. Why, and what it costs:

* truncating (dropping the examples past ``max_batch_size``, as jax_privacy does and
  documents) makes an example's inclusion depend on how many others were drawn: the batch is
  no longer a Poisson sample and the accountant's amplification-by-sampling analysis does not
  hold as stated;
* raising keeps every step that runs an exact Poisson step. The stop itself is an event that
  depends on the batch size; it has probability at most ``p = overflow_probability(N + 1, q,
  max_batch_size)`` per step on either of two neighbouring data sets (add/remove one
  example), so a run of ``T`` steps that may stop this way is ``(epsilon, delta + T p)``-DP
  for the accountant's ``(epsilon, delta)``. :func:`fixed_batch_size` chooses the smallest
  size whose ``T p`` is below a bound you give (e.g. ``delta / 1000``), after which the stop
  is negligible next to ``delta``;
* the batch of step ``t`` is a pure function of ``(key, t)``: a run stopped by an overflow can
  resume with a larger ``max_batch_size`` and takes exactly the batch it would have taken.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from privacy.batch import index_rows
from privacy.errors import PrivacyError
from privacy.sampling import PoissonSampler


class BatchOverflowError(PrivacyError):
    """A Poisson batch larger than the fixed ``max_batch_size``: raised, never truncated."""

    def __init__(self, step: int, size: int, max_batch_size: int, probability: float):
        self.step, self.size, self.max_batch_size, self.probability = step, size, max_batch_size, probability
        super().__init__(
            f"step {step} sampled {size} examples, more than max_batch_size={max_batch_size} (probability "
            f"{probability:.3g} per step). Truncating would break the Poisson sampling the privacy analysis "
            f"assumes, so nothing is dropped; resume with a larger max_batch_size (privacy.padding."
            f"fixed_batch_size picks one) and this step takes the same batch")


def overflow_probability(num_examples: int, sample_rate: float, max_batch_size: int) -> float:
    """``P(Binomial(num_examples, sample_rate) > max_batch_size)``: the chance that one step's
    Poisson batch does not fit. Exact up to float rounding (log-space terms of the upper tail,
    summed from the largest); 0 when ``max_batch_size >= num_examples``."""
    n, q, m = int(num_examples), float(sample_rate), int(max_batch_size)
    if m >= n:
        return 0.0
    if m < 0:
        return 1.0
    if q >= 1.0:
        return 1.0
    log_q, log_1q = math.log(q), math.log1p(-q)

    def log_pmf(k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_q + (n - k) * log_1q

    start = max(m + 1, min(n, int(n * q)))  # the tail's largest term: at its first k or the mode
    peak = log_pmf(start)
    total = 0.0
    for ks in (range(start, n + 1), range(start - 1, m, -1)):
        for k in ks:
            term = math.exp(log_pmf(k) - peak)
            total += term
            if term < 1e-18 * total:
                break
    return min(1.0, total * math.exp(peak))


def fixed_batch_size(num_examples: int, sample_rate: float, *, steps: int, overflow_bound: float) -> int:
    """The smallest ``max_batch_size`` with ``steps * overflow_probability(num_examples + 1,
    sample_rate, size) <= overflow_bound``: over the whole run, the chance of a
    :class:`BatchOverflowError` on the data set or on a neighbour with one more example is at
    most ``overflow_bound``, the term the stop adds to delta (module docstring). Raises
    :class:`PrivacyError` for ``overflow_bound`` outside ``(0, 1)`` or ``steps < 1``."""
    if not 0 < overflow_bound < 1 or steps < 1:
        raise PrivacyError(f"need 0 < overflow_bound < 1 and steps >= 1, got {overflow_bound}, {steps}")
    n = int(num_examples) + 1
    lo, hi = 0, n  # overflow_probability(n, q, n) == 0
    while lo < hi:
        mid = (lo + hi) // 2
        if steps * overflow_probability(n, sample_rate, mid) <= overflow_bound:
            hi = mid
        else:
            lo = mid + 1
    return lo


def pad_batch(data: tuple[Any, Tensor], indices: Tensor, max_batch_size: int, *, step: int = -1,
              sample_rate: float | None = None) -> tuple[Any, Tensor, Tensor]:
    """``(inputs, targets, mask)`` of exactly ``max_batch_size`` rows: the rows ``indices`` of
    ``data`` (``(inputs, targets)``, inputs as ``privacy.batch`` reads them, every tensor that
    leads with the data set size indexed), then copies of row 0 of ``data`` with ``mask``
    False. Padding with a real row keeps every input valid (token ids in range, a finite loss),
    though the mask alone already makes a padding row contribute nothing.

    Raises :class:`BatchOverflowError` (with ``step`` and, given ``sample_rate``, the per-step
    overflow probability) when ``len(indices) > max_batch_size``, and :class:`PrivacyError`
    for ``max_batch_size < 1``."""
    if max_batch_size < 1:
        raise PrivacyError(f"max_batch_size must be >= 1, got {max_batch_size}")
    inputs, targets = data
    n = int(targets.shape[0])
    size = int(indices.shape[0])
    if size > max_batch_size:
        p = overflow_probability(n, sample_rate, max_batch_size) if sample_rate is not None else float("nan")
        raise BatchOverflowError(step, size, max_batch_size, p)
    rows = torch.cat([indices.to(torch.int64), torch.zeros(max_batch_size - size, dtype=torch.int64)])
    mask = torch.arange(max_batch_size) < size
    return index_rows(inputs, rows, n), targets[rows], mask


def sample_padded_batch(data: tuple[Any, Tensor], sampler: PoissonSampler, step: int,
                        max_batch_size: int) -> tuple[Any, Tensor, Tensor]:
    """Step ``step``'s Poisson batch (``sampler.indices(step)``, as ``privacy.step.sample_batch``
    takes it) padded to ``max_batch_size`` by :func:`pad_batch`: the same real rows in the same
    order, then masked padding, so every step has one shape. Raises
    :class:`BatchOverflowError` rather than truncate (module docstring)."""
    return pad_batch(data, sampler.indices(step), max_batch_size, step=step, sample_rate=sampler.sample_rate)
