"""A buffered linear Toeplitz (BLT) strategy as data: its coefficients, its noise streamed from
``D`` buffers, its sensitivity under min-separated participation, and its optimised parameters.

A BLT with buffer decays ``theta`` and output scales ``omega`` (``D`` of each) is the
lower-triangular Toeplitz strategy ``C`` whose first column is ``c_0 = 1`` and
``c_j = sum_i omega_i theta_i^(j-1)`` for ``j >= 1`` (Dvijotham, McMahan et al. 2024, "Efficient
and near-optimal noise generation for streaming differential privacy"; jax_privacy's
``matrix_factorization.buffered_toeplitz`` uses the same parameters). Unlike a banded ``C``, every
earlier output enters ``C w = z``, but through ``D`` geometric sums: with buffers
``s_i(t) = sum_{k<t} theta_i^(t-1-k) w_k``,

    w_t = z_t - sum_i omega_i s_i(t),      s_i(t+1) = theta_i s_i(t) + w_t,

so a step's noise needs one draw and ``D`` buffers the size of the parameter, whatever ``t``
(:func:`blt_step`).

In training it is the ``blt`` kind of ``privacy.mechanisms.Mechanism`` (:func:`blt_mechanism`,
``fsdpx train --noise-mechanism blt --buffers D --min-separation B``): the ``D`` buffers are the
state's ``noise_history`` (float64, like a banded history: the recursion must give the same bits
on every shard, and float32 buffers would round differently from the dense ``C^{-1} z`` it
streams), advanced by ``privacy.mechanisms.correlated.stream_step``. Its columns overlap across
participations, so it is accounted without amplification, as one Gaussian mechanism at its
min-separation sensitivity (``privacy.mechanisms.accounting``, module doc).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import torch
from torch import Tensor

from privacy.errors import PrivacyError

from .mechanism import Mechanism, blt_parameters
from .optimize import prefix_sum_error
from .toeplitz import toeplitz_matrix


@dataclasses.dataclass(frozen=True)
class BufferedToeplitz:
    """The BLT strategy with buffer ``decays`` (``theta``) and output ``scales`` (``omega``).

    Formal Guarantees: ``coefficients(n)`` is ``C``'s first column
    (``tests/test_blt.py::test_blt_coefficients_are_the_geometric_sums``); with ``0 < theta < 1``,
    ``omega > 0`` and ``sum(omega) <= 1`` (checked here) the column is positive and non-increasing,
    which :func:`blt_sensitivity` needs.
    Edge cases: ``decays`` and ``scales`` of different lengths, a decay outside ``(0, 1)``, a scale
    not ``> 0``, ``sum(scales) > 1`` or non-finite values raise ``PrivacyError`` naming them;
    ``D = 0`` is ``C = I`` (independent noise)."""

    decays: tuple[float, ...]
    scales: tuple[float, ...]

    def __post_init__(self) -> None:
        theta, omega = blt_parameters(self.decays, self.scales)
        object.__setattr__(self, "decays", theta)
        object.__setattr__(self, "scales", omega)

    @property
    def buffers(self) -> int:
        """``D``, the number of buffers (of a parameter's size) its noise keeps."""
        return len(self.decays)

    def coefficients(self, n: int) -> Tensor:
        """The first ``n`` entries of ``C``'s first column, float64: ``1`` then
        ``sum_i omega_i theta_i^(j-1)``."""
        if n < 1:
            raise PrivacyError(f"n must be >= 1, got n={n}")
        return blt_column(torch.tensor(self.decays, dtype=torch.float64),
                          torch.tensor(self.scales, dtype=torch.float64), n)


def blt_column(decays: Tensor, scales: Tensor, n: int) -> Tensor:
    """``[1, sum_i scales_i decays_i^(j-1) for j in 1..n-1]``, differentiable in both."""
    powers = decays.view(1, -1) ** torch.arange(n - 1, dtype=decays.dtype).view(-1, 1)  # (n-1, D)
    return torch.cat([torch.ones(1, dtype=decays.dtype), (powers * scales.view(1, -1)).sum(1)])


def empty_buffers(blt: BufferedToeplitz, like: Tensor) -> list[Tensor]:
    """``D`` zero float64 buffers shaped like ``like``, on its device: the state before step 0."""
    return [torch.zeros(like.shape, dtype=torch.float64, device=like.device) for _ in range(blt.buffers)]


def blt_step(blt: BufferedToeplitz, z: Tensor, buffers: Sequence[Tensor | None]) -> tuple[Tensor, list[Tensor]]:
    """``(w_t, buffers after step t)``: ``w_t = z_t - sum_i omega_i s_i`` and
    ``s_i <- theta_i s_i + w_t``, elementwise in float64 on ``z``'s device (a buffer read back
    from a checkpoint on the host is read there); a ``None`` buffer is zero (not yet written).

    Formal Guarantees: from :func:`empty_buffers`, the outputs are ``C^{-1}`` times the stacked
    draws to float64 rounding (``tests/test_blt.py::test_blt_noise_is_the_inverse_strategy_times_the_draws``);
    elementwise, so any block of the inputs gives that block of the outputs, bit for bit.
    Edge cases: ``len(buffers) != D`` raises ``ValueError``."""
    if len(buffers) != blt.buffers:
        raise ValueError(f"{len(buffers)} buffers for a BLT of {blt.buffers}")
    w = z.to(torch.float64)
    buffers = [None if s is None else s.to(w.device) for s in buffers]
    for omega, s in zip(blt.scales, buffers):
        if s is not None:
            w = w - s * omega  # two roundings, no fused multiply-add: the same bits on every device
    return w, [w if s is None else s * theta + w for theta, s in zip(blt.decays, buffers)]


def strategy_of(mechanism: Mechanism) -> BufferedToeplitz:
    """The BLT of a mechanism of kind "blt" (``PrivacyError`` for another kind)."""
    if mechanism.kind != "blt":
        raise PrivacyError(f"a mechanism of kind {mechanism.kind!r} has no BLT strategy")
    return BufferedToeplitz(mechanism.decays, mechanism.scales)


def blt_mechanism(blt: BufferedToeplitz, min_sep: int) -> Mechanism:
    """The noise mechanism that streams ``blt``'s noise, accounted for participations at least
    ``min_sep`` steps apart (cyclic groups of ``min_sep``)."""
    return Mechanism("blt", decays=blt.decays, scales=blt.scales, min_sep=min_sep)


def blt_sensitivity(blt: BufferedToeplitz, steps: int, *, participations: int, min_sep: int) -> float:
    """The L2 sensitivity of ``C`` over ``steps`` steps when an example takes part at most
    ``participations`` times, any two at least ``min_sep`` steps apart: the norm of the sum of
    columns ``0, min_sep, 2 min_sep, ...`` (as many as fit). For a Toeplitz ``C`` with a positive,
    non-increasing column (every ``BufferedToeplitz``) that pattern is the worst (McMahan et al.
    2024; Kalinin and Lampert 2024).

    Formal Guarantee: equals ``privacy.mechanisms.min_sep_sensitivity``, the exhaustive maximum,
    on small cases (``tests/test_blt.py::test_blt_sensitivity_equals_the_brute_force_maximum``).
    Edge cases: ``steps``, ``min_sep`` < 1 or ``participations`` < 0 raise ``PrivacyError``;
    0 participations give 0.0."""
    if steps < 1 or min_sep < 1 or participations < 0:
        raise PrivacyError(f"steps and min_sep must be >= 1 and participations >= 0, got steps={steps}, "
                           f"min_sep={min_sep}, participations={participations}")
    return math.sqrt(_sensitivity_squared(blt.coefficients(steps), steps, participations, min_sep).item())


def _sensitivity_squared(column: Tensor, steps: int, participations: int, min_sep: int) -> Tensor:
    chosen = list(itertools.islice(range(0, steps, min_sep), participations))
    if not chosen:
        return torch.zeros((), dtype=column.dtype)
    summed = toeplitz_matrix(column, steps)[:, chosen].sum(1)
    return (summed * summed).sum()


def blt_error(blt: BufferedToeplitz, steps: int, *, participations: int, min_sep: int,
              objective: str = "total") -> float:
    """The squared error of the prefix-sum workload with the BLT strategy at its sensitivity:
    ``sens^2 * ||A C^{-1}||^2`` (``objective`` "total": Frobenius; "max": the largest row),
    the quantity :func:`optimal_blt` minimises, comparable across mechanisms at equal privacy
    (independent noise: ``participations * n (n + 1) / 2`` for "total")."""
    return float(_loss(torch.tensor(blt.decays, dtype=torch.float64), torch.tensor(blt.scales, dtype=torch.float64),
                       steps, participations, min_sep, objective))


def _loss(decays: Tensor, scales: Tensor, steps: int, participations: int, min_sep: int, objective: str) -> Tensor:
    column = blt_column(decays, scales, steps)
    # prefix_sum_error scales the column to unit norm: multiply back by its squared norm
    error = prefix_sum_error(column, steps, objective) / (column * column).sum()
    return error * _sensitivity_squared(column, steps, participations, min_sep)


def optimal_blt(buffers: int, steps: int, *, participations: int, min_sep: int, objective: str = "total",
                iterations: int = 200) -> BufferedToeplitz:
    """The BLT of ``buffers`` buffers minimising :func:`blt_error` over ``steps`` steps (L-BFGS on
    unconstrained parameters: ``theta = sigmoid(a)``, ``omega = softmax([b, 0])[:-1]`` so that the
    scales are positive and sum below 1), started from decays spread over ``[0.2, 0.9]`` and
    scales ``1 / (2 D)`` each.

    Formal Guarantees: deterministic; its error is at most its starting point's, and below the
    independent mechanism's (``tests/test_blt.py::test_optimised_blt_beats_independent_noise``).
    Edge cases: ``buffers`` < 1 raises ``PrivacyError``; other arguments as :func:`blt_sensitivity`."""
    if buffers < 1:
        raise PrivacyError(f"buffers must be >= 1, got buffers={buffers}")
    blt_sensitivity(BufferedToeplitz((0.5,), (0.5,)), steps, participations=participations, min_sep=min_sep)
    a = torch.logit(torch.linspace(0.2, 0.9, buffers, dtype=torch.float64)).requires_grad_(True)
    b = torch.full((buffers,), -math.log(buffers), dtype=torch.float64).requires_grad_(True)

    def unpack() -> tuple[Tensor, Tensor]:
        weights = torch.softmax(torch.cat([b, torch.zeros(1, dtype=torch.float64)]), 0)
        return torch.sigmoid(a), weights[:-1]

    def loss() -> Tensor:
        return _loss(*unpack(), steps, participations, min_sep, objective)

    with torch.no_grad():
        start = _as_blt(*unpack())
    opt = torch.optim.LBFGS([a, b], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure() -> Tensor:
        opt.zero_grad()
        value = loss()
        value.backward()
        return value

    opt.step(closure)
    with torch.no_grad():
        try:
            found = _as_blt(*unpack())
        except PrivacyError:  # a decay rounded to 0 or 1 at the edge of its domain
            return start
    kw = dict(participations=participations, min_sep=min_sep, objective=objective)
    error = blt_error(found, steps, **kw)
    return found if math.isfinite(error) and error <= blt_error(start, steps, **kw) else start


def _as_blt(decays: Tensor, scales: Tensor) -> BufferedToeplitz:
    return BufferedToeplitz(tuple(decays.tolist()), tuple(scales.tolist()))
