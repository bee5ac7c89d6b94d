"""Poisson sampling of training examples, a pure function of ``(key, step)``.

DP-SGD's privacy amplification by subsampling assumes each example enters each step's batch
independently with probability ``sample_rate``. ``PoissonSampler`` draws exactly that, with no
state: the batch of step ``t`` is recomputed from ``(key, t)``, so resuming from a checkpoint,
skipping ahead or replaying a step needs only the sampler's config (``to_dict``) and the step.

Randomness: one numpy ``SFC64`` generator per step, seeded with a 128-bit BLAKE2b hash of
``(key, step)``. Not ``torch.Generator``: its CPU generator keeps only 32 bits of the seed, so
over a long run two steps would share a seed (birthday bound) and draw the same batch, which
breaks the independence across steps the accounting assumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import operator
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from ckpt.flatten import register_type
from privacy.errors import PrivacyError

_HASH_PERSON = b"fsdpx.sample.v1"

SKIP_ABOVE = 1 << 24
"""Datasets of more examples than this (16.8 million: a token file of 1 G tokens cut into
64-token examples) draw a step's batch by geometric skips (:func:`skip_draw`), in time and
memory of the batch; up to it, by a uniform per example (:func:`mask_draw`), the batches every
run has drawn so far, bit for bit (a checkpoint resumes with the same batches)."""

MASK_CHUNK = 1 << 20
"""Uniforms drawn at once by :func:`mask_draw`: 8 MiB, whatever the dataset's size."""


def mask_draw(gen: np.random.Generator, num_examples: int, sample_rate: float) -> np.ndarray:
    """The sorted indices ``i`` whose uniform ``u_i < sample_rate``, ``u`` drawn from ``gen`` in
    order. Drawn in chunks of :data:`MASK_CHUNK`: ``Generator.random`` turns each 64-bit output
    into one double, so chunks give the uniforms of one ``gen.random(num_examples)``, and the
    same indices, without an array of the dataset's size."""
    parts = []
    for lo in range(0, num_examples, MASK_CHUNK):
        u = gen.random(min(MASK_CHUNK, num_examples - lo))
        parts.append(np.flatnonzero(u < sample_rate).astype(np.int64, copy=False) + lo)
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


def skip_draw(gen: np.random.Generator, num_examples: int, sample_rate: float) -> np.ndarray:
    """Sorted indices, each of ``range(num_examples)`` in independently with probability
    ``sample_rate``: the gaps between successive successes of Bernoulli trials are independent
    geometric variables (support 1, 2, ...), so the included indices are the partial sums of
    geometric gaps, minus one, below ``num_examples``. Time and memory of the batch (about
    ``num_examples * sample_rate``), not of the dataset; numpy's geometric sampler inverts a
    uniform, exact up to float64 rounding as :func:`mask_draw`'s comparison is."""
    expected = num_examples * sample_rate
    chunk = max(1024, int(expected + 6 * math.sqrt(expected) + 16))
    parts, last = [], -1
    while last < num_examples:
        positions = last + np.cumsum(gen.geometric(sample_rate, size=chunk).astype(np.int64, copy=False))
        parts.append(positions)
        last = int(positions[-1])
    indices = np.concatenate(parts)
    return indices[: np.searchsorted(indices, num_examples)]


@dataclasses.dataclass(frozen=True)
class PoissonSampler:
    """Each example in ``range(num_examples)`` is in step ``t``'s batch independently with
    probability ``sample_rate``.

    Formal Guarantees:
      * ``indices(t)`` is a sorted, duplicate-free int64 tensor of values in
        ``[0, num_examples)`` (``test_indices_are_sorted_unique_and_in_range``).
      * Pure: equal ``(num_examples, sample_rate, key, t)`` give equal indices, in any order of
        calls and in any process (``test_indices_are_a_pure_function_of_key_and_step``).
      * Each example is included with probability ``sample_rate`` up to float64 rounding (a
        uniform in ``[0, 1)`` on a ``2**-53`` grid is compared with ``sample_rate``),
        independently of other examples and of other steps
        (``test_empirical_inclusion_rate_matches_sample_rate``,
        ``test_different_steps_draw_different_batches``).
      * Cost: O(num_examples) time and O(MASK_CHUNK) memory per call up to
        :data:`SKIP_ABOVE` examples (the mask is drawn in chunks: the same uniforms, so the same
        indices, as one ``gen.random(num_examples)``: ``test_chunked_mask_is_the_draw_of_one_mask``);
        above it, O(batch size) time and memory (:func:`skip_draw`: geometric gaps, the same
        distribution, other bits: ``test_skip_draw_has_the_bernoulli_distribution``). Nothing is
        cached.

    Edge cases:
      ==========================  ==============================================
      ``sample_rate == 1``        every example, every step
      empty draw                  an empty int64 tensor (the step still counts)
      ``sample_rate`` outside     ``PrivacyError`` naming ``sample_rate``
      (0, 1] or NaN
      ``num_examples < 1``        ``PrivacyError`` naming ``num_examples``
      ``step < 0``                ``PrivacyError`` naming ``step``
      ==========================  ==============================================
    """

    num_examples: int
    sample_rate: float
    key: int

    def __post_init__(self) -> None:
        if isinstance(self.num_examples, bool) or not isinstance(self.num_examples, numbers.Integral):
            raise PrivacyError(f"num_examples must be an int, got {self.num_examples!r}")
        if self.num_examples < 1:
            raise PrivacyError(f"num_examples must be >= 1, got num_examples={self.num_examples}")
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, numbers.Real):
            raise PrivacyError(f"sample_rate must be a real number, got {self.sample_rate!r}")
        if not 0.0 < self.sample_rate <= 1.0:  # also rejects NaN
            raise PrivacyError(f"sample_rate must be in (0, 1], got sample_rate={self.sample_rate}")
        object.__setattr__(self, "num_examples", int(self.num_examples))
        object.__setattr__(self, "sample_rate", float(self.sample_rate))
        object.__setattr__(self, "key", operator.index(self.key))

    @property
    def expected_batch_size(self) -> float:
        """``num_examples * sample_rate``: the mean batch size (the denominator DP-SGD divides
        the noisy gradient sum by, since the true size is itself private)."""
        return self.num_examples * self.sample_rate

    def indices(self, step: int) -> Tensor:
        """The sorted example indices of step ``step``'s batch (int64, possibly empty)."""
        step = operator.index(step)
        if step < 0:
            raise PrivacyError(f"step must be >= 0, got step={step}")
        if self.sample_rate == 1.0:
            return torch.arange(self.num_examples, dtype=torch.int64)
        digest = hashlib.blake2b(f"{self.key}:{step}".encode(), digest_size=16, person=_HASH_PERSON).digest()
        gen = np.random.Generator(np.random.SFC64(int.from_bytes(digest, "little")))
        if self.num_examples > SKIP_ABOVE:
            return torch.from_numpy(skip_draw(gen, self.num_examples, self.sample_rate))
        return torch.from_numpy(mask_draw(gen, self.num_examples, self.sample_rate))

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(step, indices(step))`` for ``start_step, start_step + 1, ...``; ``num_steps``
        of them, or without end when it is None."""
        if num_steps is not None and num_steps < 0:
            raise PrivacyError(f"num_steps must be >= 0 or None, got num_steps={num_steps}")
        stop = math.inf if num_steps is None else start_step + num_steps
        step = start_step
        while step < stop:
            yield step, self.indices(step)
            step += 1

    def to_dict(self) -> dict[str, Any]:
        """The sampler's whole config as JSON types; ``from_dict(to_dict())`` is equal to it."""
        return {"num_examples": self.num_examples, "sample_rate": self.sample_rate, "key": self.key}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> PoissonSampler:
        """Inverse of ``to_dict``; unknown or missing fields raise ``PrivacyError``."""
        expected = {"num_examples", "sample_rate", "key"}
        if set(config) != expected:
            raise PrivacyError(
                f"PoissonSampler config needs exactly {sorted(expected)}, "
                f"got missing {sorted(expected - set(config))}, unexpected {sorted(set(config) - expected)}"
            )
        return cls(num_examples=config["num_examples"], sample_rate=config["sample_rate"], key=config["key"])


# ckpt stores states without pickle, by registered type: privacy registers its own types
register_type("PoissonSampler", PoissonSampler, PoissonSampler.to_dict, PoissonSampler.from_dict)
