"""Lower-triangular Toeplitz matrices given by their first column, and their inverses.

A banded strategy ``C`` (``privacy.mechanisms.mechanism``) is lower-triangular Toeplitz: entry
``C[t, k]`` is ``c[t - k]`` for ``0 <= t - k < len(c)`` and 0 elsewhere. Its inverse is again
lower-triangular Toeplitz (dense, not banded), and the first ``n`` entries of the inverse's
first column do not depend on how many more steps follow: the noise of step ``t`` is the same
whatever the run's length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def toeplitz_matrix(column: Tensor, n: int) -> Tensor:
    """The ``n x n`` lower-triangular Toeplitz matrix whose first column starts with ``column``
    (zeros after it; entries of ``column`` past ``n`` are dropped). Differentiable in
    ``column``. Guarantee: ``M[t, k] == column[t - k]`` for ``0 <= t - k < len(column)``, else 0
    (``tests/test_mechanisms.py::test_inverse_coefficients_invert_the_toeplitz_matrix``)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got n={n}")
    padded = torch.zeros(n, dtype=column.dtype)
    m = min(n, column.numel())
    padded = torch.cat([column[:m], padded[m:]])
    lags = torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)  # (n, n): t - k
    return torch.where(lags >= 0, padded[lags.clamp(min=0)], torch.zeros((), dtype=column.dtype))


def inverse_coefficients(column: tuple[float, ...], n: int) -> tuple[float, ...]:
    """The first ``n`` entries of the first column of the inverse of the lower-triangular
    Toeplitz matrix with first column ``column``, in float64: ``d[0] = 1 / c[0]`` and
    ``d[j] = -(sum_{i=1..min(j, b-1)} c[i] d[j-i]) / c[0]``.

    Guarantees: ``toeplitz_matrix(d) @ toeplitz_matrix(c)`` is the identity to float64 rounding
    (``test_inverse_coefficients_invert_the_toeplitz_matrix``); ``d[:m]`` of a call with ``n``
    equals the call with ``m <= n`` (the recurrence only reads earlier entries).
    Edge cases: ``c[0] == 0`` (singular) raises ``ValueError``; ``n == 0`` gives ``()``."""
    if not column or column[0] == 0.0:
        raise ValueError(f"the strategy's first coefficient must be non-zero, got {column[:1]}")
    c0 = float(column[0])
    d: list[float] = []
    for j in range(n):
        acc = 1.0 if j == 0 else 0.0
        for i in range(1, min(j, len(column) - 1) + 1):
            acc -= column[i] * d[j - i]
        d.append(acc / c0)
    return tuple(d)
