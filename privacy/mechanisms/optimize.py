"""Coefficients of a banded strategy that minimise the error of the prefix-sum workload.

The model after ``n`` steps of SGD is (up to the learning rate) a prefix sum of noised gradients:
the workload ``A`` is the lower-triangular matrix of ones. With strategy ``C`` (unit column
norm, so sensitivity 1 per participation under ``b``-min-separation) the error of the released
prefix sums is ``B z`` with ``B = A C^{-1}``. For Toeplitz ``C``, ``B`` is lower-triangular
Toeplitz with first column ``s = cumsum(d)``, ``d`` the first column of ``C^{-1}``; so

  * total squared error ``||B||_F^2 = sum_j (n - j) s_j^2`` (all rows),
  * max squared error  ``max_t ||B[t]||^2 = sum_j s_j^2`` (the last row),

as in Choquette-Choo et al. 2023 ("(Amplified) Banded Matrix Factorization", section 4),
minimised over ``b`` free coefficients with L-BFGS on the column-normalised parameterisation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from privacy.errors import PrivacyError

from .mechanism import INDEPENDENT, Mechanism, banded
from .toeplitz import toeplitz_matrix

OBJECTIVES = ("total", "max")


def prefix_sum_error(coefficients: Tensor, steps: int, objective: str = "total") -> Tensor:
    """The squared error of the prefix-sum workload over ``steps`` steps with the Toeplitz
    strategy whose first column is ``coefficients / ||coefficients||`` (unit sensitivity), per
    unit noise variance: ``||A C^{-1}||_F^2`` ("total") or its largest squared row norm ("max").
    Differentiable. Guarantee: equals the dense computation ``A @ inverse(C)``
    (``tests/test_mechanisms.py::test_prefix_sum_error_equals_the_dense_product``); for
    independent noise ("total") it is ``n (n + 1) / 2``."""
    if objective not in OBJECTIVES:
        raise PrivacyError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    c = coefficients.to(torch.float64) / coefficients.to(torch.float64).norm()
    strategy = toeplitz_matrix(c, steps)
    unit = torch.zeros(steps, 1, dtype=torch.float64)
    unit[0] = 1.0
    d = torch.linalg.solve_triangular(strategy, unit, upper=False).view(-1)  # first column of C^{-1}
    s = torch.cumsum(d, 0)  # first column of B = A C^{-1}
    if objective == "max":
        return (s * s).sum()
    weights = torch.arange(steps, 0, -1, dtype=torch.float64)
    return (weights * s * s).sum()


def _sqrt_start(bands: int) -> Tensor:
    # The Toeplitz square root of A (c_j = binom(2j, j) / 4^j) cut to b bands: near-optimal
    # for large b and a good start for small b.
    c = [1.0]
    for j in range(1, bands):
        c.append(c[-1] * (2 * j - 1) / (2 * j))
    return torch.tensor(c, dtype=torch.float64)


def optimal_banded(bands: int, steps: int, *, objective: str = "total", iterations: int = 200) -> Mechanism:
    """The banded mechanism with ``bands`` bands whose strategy minimises
    :func:`prefix_sum_error` over ``steps`` steps (L-BFGS from the truncated square root of ``A``).

    Formal Guarantees:
      * Deterministic: equal arguments give equal coefficients (float64 on the CPU).
      * Its error is at most that of its starting point and so, for ``bands >= 2``, below the
        independent mechanism's ``n (n + 1) / 2``
        (``test_optimised_bands_beat_independent_noise_and_improve_with_bands``).
    Edge cases: ``bands == 1`` is the independent mechanism; ``bands > steps`` is cut to
    ``steps`` (more bands do not exist in ``steps`` steps); ``bands`` or ``steps < 1`` raise
    ``PrivacyError`` naming them."""
    if bands < 1:
        raise PrivacyError(f"bands must be >= 1, got bands={bands}")
    if steps < 1:
        raise PrivacyError(f"steps must be >= 1, got steps={steps}")
    bands = min(bands, steps)
    if bands == 1:
        return INDEPENDENT
    theta = _sqrt_start(bands).requires_grad_(True)
    best = (prefix_sum_error(theta.detach(), steps, objective).item(), theta.detach().clone())
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = prefix_sum_error(theta, steps, objective)
        loss.backward()
        return loss

    opt.step(closure)
    final = prefix_sum_error(theta.detach(), steps, objective).item()
    if math.isfinite(final) and final <= best[0] and theta.detach()[0] != 0:
        best = (final, theta.detach().clone())
    return banded(tuple(best[1].tolist()))
