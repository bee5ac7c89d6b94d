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


# Workloads other than prefix sums. SGD with heavy-ball momentum ``beta`` and a constant learning
# rate moves the parameters by ``lr * sum_k W[t, k] g_k`` after step ``t``, with
# ``W[t, k] = sum_{s=k..t} beta^{s-k} = (1 - beta^{t-k+1}) / (1 - beta)``: a lower-triangular
# Toeplitz workload like prefix sums (``beta = 0``), whose column grows to ``1 / (1 - beta)``.
# The banded coefficients that serve it best differ from the prefix-sum ones (jax_privacy
# optimises its strategies for momentum and a learning-rate cooldown for this reason).


def momentum_workload(steps: int, momentum: float) -> Tensor:
    """The first column ``w`` of the workload of SGD with heavy-ball momentum ``momentum`` over
    ``steps`` steps (constant learning rate, torch's convention): ``w_j = sum_{i<=j} momentum^i``,
    float64.

    Guarantee: ``momentum == 0`` gives ones (the prefix-sum workload); ``W = toeplitz(w)``
    applied to the gradients is the parameters' displacement per unit learning rate
    (``tests/test_mechanisms_workload.py::test_momentum_workload_is_what_sgd_with_momentum_applies``).
    Edge cases: ``steps < 1`` or ``momentum`` outside ``[0, 1)`` raise ``PrivacyError``."""
    if steps < 1:
        raise PrivacyError(f"steps must be >= 1, got steps={steps}")
    if not 0.0 <= momentum < 1.0:
        raise PrivacyError(f"momentum must be in [0, 1), got momentum={momentum}")
    return torch.cumsum(momentum ** torch.arange(steps, dtype=torch.float64), 0)


def workload_error(coefficients: Tensor, workload: Tensor, objective: str = "total") -> Tensor:
    """The squared error ``||W C^{-1}||_F^2`` ("total") or its largest squared row norm ("max"),
    per unit noise variance, of the lower-triangular Toeplitz workload ``W`` whose first column
    is ``workload`` (``n = len(workload)`` steps) under the Toeplitz strategy whose first column
    is ``coefficients / ||coefficients||`` (unit sensitivity). Differentiable in ``coefficients``.

    Guarantee: equals the dense ``W @ inverse(C)``; with ``workload`` all ones it is
    :func:`prefix_sum_error` (``test_workload_error_equals_the_dense_product``).
    Edge cases: an unknown ``objective`` raises ``PrivacyError``."""
    if objective not in OBJECTIVES:
        raise PrivacyError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    w = workload.to(torch.float64)
    steps = w.numel()
    c = coefficients.to(torch.float64) / coefficients.to(torch.float64).norm()
    unit = torch.zeros(steps, 1, dtype=torch.float64)
    unit[0] = 1.0
    d = torch.linalg.solve_triangular(toeplitz_matrix(c, steps), unit, upper=False).view(-1)
    s = toeplitz_matrix(w, steps) @ d  # first column of B = W C^{-1} (Toeplitz times Toeplitz)
    if objective == "max":
        return (s * s).sum()
    weights = torch.arange(steps, 0, -1, dtype=torch.float64)
    return (weights * s * s).sum()


def optimal_banded_for_workload(bands: int, workload: Tensor, *, objective: str = "total",
                                iterations: int = 200) -> Mechanism:
    """The banded mechanism with ``bands`` bands whose strategy minimises :func:`workload_error`
    for the Toeplitz workload with first column ``workload`` (e.g. :func:`momentum_workload`),
    by L-BFGS from the truncated square root of the prefix-sum workload.

    Formal Guarantees:
      * Deterministic (float64 on the CPU).
      * Its workload error is at most its starting point's, and at most that of
        :func:`optimal_banded`'s prefix-sum coefficients plus 1e-9 relative (both are tried; the
        better is kept): for momentum the result is never worse for the workload it serves
        (``test_momentum_optimised_bands_serve_momentum_better_than_prefix_sum_bands``); with
        ``workload`` all ones it is :func:`optimal_banded`'s mechanism to optimiser tolerance
        (``test_momentum_zero_reproduces_the_prefix_sum_optimiser``).
    Edge cases: ``bands == 1`` is the independent mechanism; ``bands > len(workload)`` is cut;
    ``bands < 1`` or an empty workload raise ``PrivacyError``."""
    steps = workload.numel()
    if bands < 1:
        raise PrivacyError(f"bands must be >= 1, got bands={bands}")
    if steps < 1:
        raise PrivacyError("the workload must have at least one step")
    bands = min(bands, steps)
    if bands == 1:
        return INDEPENDENT
    w = workload.detach().to(torch.float64)
    scale = workload_error(torch.ones(1, dtype=torch.float64), w, objective).item()  # independent noise's: 1 below

    def relative(theta: Tensor) -> Tensor:
        return workload_error(theta, w, objective) / scale

    starts = (_sqrt_start(bands), torch.tensor(optimal_banded(bands, steps, objective=objective).coefficients))
    best = min(((relative(s).item(), s) for s in starts), key=lambda e: e[0])
    theta = best[1].clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = relative(theta)
        loss.backward()
        return loss

    opt.step(closure)
    final = relative(theta.detach()).item()
    if math.isfinite(final) and final <= best[0] and theta.detach()[0] != 0:
        best = (final, theta.detach().clone())
    return banded(tuple(best[1].tolist()))
