"""Cyclic Poisson sampling: the batch sampler that makes a banded mechanism's participations
``b`` steps apart (Choquette-Choo et al. 2023's amplified b-min-separation sampler).

Example ``i`` belongs to group ``i mod groups``; step ``t`` samples only group ``t mod groups``,
each of its examples independently with probability ``sample_rate``. So an example takes part
only at steps ``groups`` apart, and within them enjoys Poisson amplification at ``sample_rate``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from torch import Tensor

from ckpt.flatten import register_type
from privacy.errors import PrivacyError
from privacy.sampling import PoissonSampler


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampler:
    """Step ``t``'s batch: the examples ``i`` with ``i mod groups == t mod groups`` that a
    Poisson draw at ``sample_rate`` over that group keeps (the group's ``PoissonSampler`` with
    the run's key, drawn for step ``t``).

    Formal Guarantees:
      * ``indices(t)`` is sorted, duplicate-free, in ``[0, num_examples)`` and holds only
        examples of group ``t mod groups``: any example's participations are at least ``groups``
        steps apart (``tests/test_mechanisms.py::test_cyclic_sampler_keeps_participations_groups_apart``).
      * Pure in ``(num_examples, groups, sample_rate, key, t)``; ``groups == 1`` is
        ``PoissonSampler`` bit for bit.
      * ``expected_batch_size`` is ``sample_rate * num_examples / groups`` (the largest group's size
        rounded down for unequal groups: the divisor of every step is the same public number).
    Edge cases: ``groups < 1`` or ``groups > num_examples`` raise ``PrivacyError`` naming
    ``groups``; other arguments as ``PoissonSampler``."""

    num_examples: int
    sample_rate: float
    key: int
    groups: int = 1

    def __post_init__(self) -> None:
        PoissonSampler(self.num_examples, self.sample_rate, self.key)  # validates the shared fields
        groups = operator.index(self.groups)
        if not 1 <= groups <= self.num_examples:
            raise PrivacyError(f"groups must be in [1, num_examples={self.num_examples}], got groups={self.groups}")
        object.__setattr__(self, "groups", groups)

    def group_size(self, group: int) -> int:
        """The number of examples ``i`` with ``i mod groups == group``."""
        return len(range(group, self.num_examples, self.groups))

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * (num_examples // groups)``: the expected batch of the smallest group."""
        return self.sample_rate * (self.num_examples // self.groups)

    def indices(self, step: int) -> Tensor:
        """The sorted example indices of step ``step``'s batch (int64, possibly empty)."""
        step = operator.index(step)
        if self.groups == 1:
            return PoissonSampler(self.num_examples, self.sample_rate, self.key).indices(step)
        group = step % self.groups
        inner = PoissonSampler(self.group_size(group), self.sample_rate, self.key).indices(step)
        return inner * self.groups + group

    def to_dict(self) -> dict[str, Any]:
        """The sampler's config as JSON types."""
        return {"num_examples": self.num_examples, "sample_rate": self.sample_rate, "key": self.key,
                "groups": self.groups}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> CyclicPoissonSampler:
        """Inverse of ``to_dict``; other keys raise ``PrivacyError``."""
        if set(config) != {"num_examples", "sample_rate", "key", "groups"}:
            raise PrivacyError(f"CyclicPoissonSampler config needs num_examples, sample_rate, key, groups; "
                               f"got {sorted(config)}")
        return cls(**config)


register_type("CyclicPoissonSampler", CyclicPoissonSampler, CyclicPoissonSampler.to_dict,
              CyclicPoissonSampler.from_dict)
