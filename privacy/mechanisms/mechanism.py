"""A noise mechanism as data: the strategy matrix ``C`` of a matrix-factorization mechanism.

DP-SGD adds independent noise ``z_t`` to step ``t``'s clipped gradient sum. A matrix-factorization
mechanism (DP-FTRL; Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization") adds
``w_t = sum_k C^{-1}[t, k] z_k`` instead: the model, a prefix sum of noised gradients, then
holds ``A (x + C^{-1} z) = B (C x + z)`` with ``B = A C^{-1}``, which releases ``C x + z``, a
Gaussian mechanism of sensitivity ``sens(C)``; the error ``B z`` can be much smaller than
``A z`` when examples are seen several times.

Kinds:
  * ``independent``: ``C = I``, today's DP-SGD noise, bit for bit.
  * ``banded``: ``C`` lower-triangular Toeplitz with ``b`` bands, first column ``coefficients``
    (``c[0] > 0``), normalised to unit column norm so that its sensitivity per participation is 1.
    ``b = steps`` is the dense Toeplitz strategy of a small run.

A buffered Toeplitz (BLT) strategy is data of its own (``privacy.mechanisms.blt``), not yet a
kind the private step runs (``fsdpx train --noise-mechanism blt`` is refused by name).
"""

from __future__ import annotations

import dataclasses
import math

from privacy.errors import PrivacyError

KINDS = ("independent", "banded")


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A noise mechanism: ``kind`` and the first column ``coefficients`` of its lower-triangular
    Toeplitz strategy ``C`` (``(1.0,)`` for independent noise).

    Formal Guarantees:
      * ``coefficients`` has unit L2 norm and a positive first entry after construction (the
        given column is scaled by ``1 / norm``; its sign flipped when ``c[0] < 0``, which changes
        neither the error nor the sensitivity): every column of ``C`` has norm at most 1
        (``test_banded_columns_have_norm_at_most_one``).
      * ``bands == len(coefficients)``.

    Edge cases: unknown ``kind``, an empty, non-finite or all-zero column, ``c[0] == 0`` (``C``
    singular) or ``independent`` with a column other than ``(1.0,)`` raise ``PrivacyError``.
    """

    kind: str = "independent"
    coefficients: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PrivacyError(f"noise mechanism must be one of {KINDS}, got {self.kind!r}")
        c = tuple(float(x) for x in self.coefficients)
        if not c or not all(math.isfinite(x) for x in c):
            raise PrivacyError(f"a mechanism needs finite coefficients, got {self.coefficients!r}")
        if c[0] == 0.0:
            raise PrivacyError("the first coefficient of a strategy must be non-zero (C would be singular)")
        norm = math.sqrt(math.fsum(x * x for x in c)) * (1.0 if c[0] > 0 else -1.0)
        c = tuple(x / norm for x in c)
        if self.kind == "independent" and c != (1.0,):
            raise PrivacyError(f"the independent mechanism has coefficients (1.0,), got {self.coefficients!r}")
        object.__setattr__(self, "coefficients", c)

    @property
    def bands(self) -> int:
        """The number of bands ``b`` of ``C`` (1 for independent noise)."""
        return len(self.coefficients)

    @property
    def max_column_norm(self) -> float:
        """The largest column norm of ``C`` over any number of steps: 1.0 by normalisation
        (the first column holds every coefficient; later ones a prefix of them)."""
        return math.sqrt(math.fsum(x * x for x in self.coefficients))

    def to_dict(self) -> dict:
        """JSON types: ``{"kind": ..., "coefficients": [...]}``."""
        return {"kind": self.kind, "coefficients": list(self.coefficients)}

    @classmethod
    def from_dict(cls, data: dict) -> Mechanism:
        """Inverse of ``to_dict``; other keys raise ``PrivacyError``."""
        if set(data) != {"kind", "coefficients"}:
            raise PrivacyError(f"a mechanism needs exactly kind and coefficients, got {sorted(data)}")
        return cls(data["kind"], tuple(data["coefficients"]))


INDEPENDENT = Mechanism()
"""DP-SGD's independent noise: ``C = I``."""


def banded(coefficients: tuple[float, ...]) -> Mechanism:
    """The banded mechanism with strategy column ``coefficients`` (normalised by ``Mechanism``)."""
    return Mechanism("banded", tuple(coefficients))
