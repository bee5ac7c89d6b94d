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

  * ``blt``: a buffered linear Toeplitz ``C`` (``privacy.mechanisms.blt``: first column ``1``,
    then ``sum_i scales_i decays_i^(j-1)``) with ``D`` buffer ``decays`` and output ``scales``,
    for participations at least ``min_sep`` steps apart (cyclic groups of ``min_sep``), which its
    accounting needs (``privacy.mechanisms.accounting.blt_epsilon``). Its noise keeps ``D``
    buffers, not past outputs (:attr:`Mechanism.history_length`).
"""

from __future__ import annotations

import dataclasses
import math

from privacy.errors import PrivacyError

KINDS = ("independent", "banded", "blt")


_UNIT = 8 * 2.0 ** -52
"""How far from 1 the squared norm of a column normalised in float64 can be (a few roundings):
such a column is not scaled again, so ``Mechanism(kind, m.coefficients) == m`` bit for bit."""


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A noise mechanism: ``kind`` and the first column ``coefficients`` of its lower-triangular
    Toeplitz strategy ``C`` (``(1.0,)`` for independent noise).

    Formal Guarantees:
      * ``coefficients`` has unit L2 norm (to float64 rounding) and a positive first entry after
        construction (the given column is scaled by ``1 / norm``; its sign flipped when
        ``c[0] < 0``, which changes neither the error nor the sensitivity): every column of ``C``
        has norm at most 1 (``test_banded_columns_have_norm_at_most_one``).
      * Idempotent: a column that is unit already (its squared norm within ``_UNIT`` of 1, as
        any normalised one is) is kept bit for bit, so ``from_dict(to_dict())`` and a resumed
        run's mechanism equal the original exactly
        (``tests/test_mechanisms.py::test_a_normalised_column_is_kept_bit_for_bit``).
      * ``bands == len(coefficients)``.

    Kind ``blt``: ``decays``, ``scales`` (checked by :func:`blt_parameters`) and ``min_sep >= 1``;
    ``coefficients`` stays ``(1.0,)`` (``c_0``). The other kinds take none of the three.

    Edge cases: unknown ``kind``, an empty, non-finite or all-zero column, ``c[0] == 0`` (``C``
    singular) or ``independent`` with a column other than ``(1.0,)`` raise ``PrivacyError``; so do
    BLT fields on another kind, or a ``blt`` without buffers.
    """

    kind: str = "independent"
    coefficients: tuple[float, ...] = (1.0,)
    decays: tuple[float, ...] = ()
    scales: tuple[float, ...] = ()
    min_sep: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PrivacyError(f"noise mechanism must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "blt":
            theta, omega = blt_parameters(self.decays, self.scales)
            if not theta or self.coefficients != (1.0,):
                raise PrivacyError(f"a blt mechanism needs >= 1 buffer and coefficients (1.0,), got decays={theta}")
            if isinstance(self.min_sep, bool) or not isinstance(self.min_sep, int) or self.min_sep < 1:
                raise PrivacyError(f"a blt mechanism's min_sep must be an int >= 1, got {self.min_sep!r}")
            object.__setattr__(self, "decays", theta)
            object.__setattr__(self, "scales", omega)
            return
        if self.decays or self.scales or self.min_sep != 1:
            raise PrivacyError(f"decays, scales and min_sep are a blt mechanism's, not {self.kind!r}'s")
        c = tuple(float(x) for x in self.coefficients)
        if not c or not all(math.isfinite(x) for x in c):
            raise PrivacyError(f"a mechanism needs finite coefficients, got {self.coefficients!r}")
        if c[0] == 0.0:
            raise PrivacyError("the first coefficient of a strategy must be non-zero (C would be singular)")
        square = math.fsum(x * x for x in c)
        if c[0] < 0 or abs(square - 1.0) > _UNIT:  # a column normalised already stays as it is (idempotent)
            norm = math.sqrt(square) * (1.0 if c[0] > 0 else -1.0)
            c = tuple(x / norm for x in c)
        if self.kind == "independent" and c != (1.0,):
            raise PrivacyError(f"the independent mechanism has coefficients (1.0,), got {self.coefficients!r}")
        object.__setattr__(self, "coefficients", c)

    @property
    def bands(self) -> int:
        """The number of bands ``b`` of ``C`` (1 for independent noise)."""
        return len(self.coefficients)

    @property
    def history_length(self) -> int:
        """The entries of its noise history: ``bands - 1`` past outputs (banded, independent: 0),
        or ``D`` buffers (blt)."""
        return len(self.decays) if self.kind == "blt" else self.bands - 1

    @property
    def groups(self) -> int:
        """The cyclic sampling groups its accounting assumes: ``bands`` (banded), ``min_sep``
        (blt), 1 (independent)."""
        return self.min_sep if self.kind == "blt" else self.bands

    @property
    def ledger_fields(self) -> dict:
        """The ``privacy.accounting.Accountant`` fields of its ledger: ``bands`` (the cyclic
        groups) and ``blt`` (``(decays, scales)`` of a BLT, else None)."""
        return {"bands": self.groups, "blt": (self.decays, self.scales) if self.kind == "blt" else None}

    @property
    def max_column_norm(self) -> float:
        """The largest column norm of ``C`` over any number of steps: 1.0 by normalisation
        (the first column holds every coefficient; later ones a prefix of them)."""
        return math.sqrt(math.fsum(x * x for x in self.coefficients))

    def to_dict(self) -> dict:
        """JSON types: ``{"kind": ..., "coefficients": [...]}``, and for a blt its ``decays``,
        ``scales`` and ``min_sep`` too."""
        blt = {"decays": list(self.decays), "scales": list(self.scales), "min_sep": self.min_sep}
        return {"kind": self.kind, "coefficients": list(self.coefficients), **(blt if self.kind == "blt" else {})}

    @classmethod
    def from_dict(cls, data: dict) -> Mechanism:
        """Inverse of ``to_dict``, and of ``dataclasses.asdict`` (a checkpointed ``DPConfig``'s
        form: every field, the BLT ones at their defaults for the other kinds); other or missing
        keys raise ``PrivacyError``."""
        blt = {"decays", "scales", "min_sep"}
        need = {"kind", "coefficients"} | (blt if data.get("kind") == "blt" else set())
        if not need <= set(data) <= need | blt:
            raise PrivacyError(f"a {data.get('kind')} mechanism needs {sorted(need)} (and at most {sorted(blt)}),"
                               f" got {sorted(data)}")
        extra = {k: tuple(data[k]) if k != "min_sep" else data[k] for k in blt & set(data)}
        return cls(data["kind"], tuple(data["coefficients"]), **extra)


INDEPENDENT = Mechanism()
"""DP-SGD's independent noise: ``C = I``."""


def blt_parameters(decays, scales) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(decays, scales)`` as float tuples, checked: equal lengths, finite, every decay in
    ``(0, 1)``, every scale ``> 0`` and their sum at most 1 (so ``C``'s first column is positive
    and non-increasing, which the BLT's sensitivity needs); otherwise ``PrivacyError`` naming them."""
    theta, omega = tuple(float(x) for x in decays), tuple(float(x) for x in scales)
    if len(theta) != len(omega):
        raise PrivacyError(f"a BLT needs as many decays as scales, got {len(theta)} and {len(omega)}")
    if not all(math.isfinite(x) for x in theta + omega):
        raise PrivacyError(f"a BLT needs finite parameters, got decays={theta} scales={omega}")
    if not all(0.0 < x < 1.0 for x in theta):
        raise PrivacyError(f"a BLT's decays must be in (0, 1), got decays={theta}")
    if not all(x > 0.0 for x in omega) or math.fsum(omega) > 1.0:
        raise PrivacyError(f"a BLT's scales must be > 0 and sum to at most 1 (c_1 <= c_0), got scales={omega}")
    return theta, omega


def banded(coefficients: tuple[float, ...]) -> Mechanism:
    """The banded mechanism with strategy column ``coefficients`` (normalised by ``Mechanism``)."""
    return Mechanism("banded", tuple(coefficients))
