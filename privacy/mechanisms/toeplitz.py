"""Lower-triangular Toeplitz matrices given by their first column.

A banded strategy ``C`` (``privacy.mechanisms.mechanism``) is lower-triangular Toeplitz: entry
``C[t, k]`` is ``c[t - k]`` for ``0 <= t - k < len(c)`` and 0 elsewhere. Its inverse is again
lower-triangular Toeplitz (dense, not banded); the noise never forms it
(``privacy.mechanisms.correlated`` solves ``C w = z`` row by row), the optimiser and the tests do.
"""

from __future__ import annotations

import torch
from torch import Tensor


def toeplitz_matrix(column: Tensor, n: int) -> Tensor:
    """The ``n x n`` lower-triangular Toeplitz matrix whose first column starts with ``column``
    (zeros after it; entries of ``column`` past ``n`` are dropped). Differentiable in
    ``column``. Guarantee: ``M[t, k] == column[t - k]`` for ``0 <= t - k < len(column)``, else 0
    (``tests/test_mechanisms.py::test_toeplitz_matrix_holds_its_column_on_every_diagonal``)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got n={n}")
    padded = torch.zeros(n, dtype=column.dtype)
    m = min(n, column.numel())
    padded = torch.cat([column[:m], padded[m:]])
    lags = torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)  # (n, n): t - k
    return torch.where(lags >= 0, padded[lags.clamp(min=0)], torch.zeros((), dtype=column.dtype))
