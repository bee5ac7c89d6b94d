"""The L2 sensitivity of a strategy ``C`` under min-separated participation.

An example participates at most ``k`` times, any two participations at least ``min_sep``
steps apart (``b``-min-separation: cyclic Poisson sampling with ``b`` groups gives it, each
example's group active every ``b``-th step). Its clipped gradients ``g_i`` (norm <= 1) change
``C x`` by ``sum_i C[:, i] g_i^T``, of squared norm ``sum_{i,j} G[i, j] <g_i, g_j>`` with
``G = C^T C``; so the sensitivity is at most ``max_P sqrt(sum_{i,j in P} |G[i, j]|)`` over the
allowed participation sets ``P``, with equality when ``G >= 0`` on them (align every ``g_i``).

For a ``b``-banded ``C`` and ``min_sep >= b`` two participations touch disjoint rows, ``G`` is
zero off the diagonal on ``P``, and the sensitivity is ``sqrt(k) * max column norm``
(Choquette-Choo et al. 2023, the b-min-separation sensitivity of banded strategies): ``sqrt(k)`` for a column-normalised ``C``.
"""

from __future__ import annotations

import math

import torch

from privacy.errors import PrivacyError

from .mechanism import Mechanism
from .toeplitz import toeplitz_matrix


def banded_sensitivity(mechanism: Mechanism, *, participations: int, min_sep: int) -> float:
    """``sqrt(participations) * max column norm`` of the mechanism's ``C`` (1.0 per participation
    after normalisation): its exact sensitivity when ``min_sep >= bands``.

    Formal Guarantee: equals :func:`min_sep_sensitivity` of the dense ``C`` on small cases
    (``tests/test_mechanisms.py::test_banded_sensitivity_equals_the_brute_force_maximum``).
    Edge cases: ``min_sep < bands`` raises ``PrivacyError`` naming ``min_sep`` (participations
    would overlap inside a band: no closed form, use :func:`min_sep_sensitivity` on a small
    run); ``participations < 0`` raises; 0 participations give 0.0."""
    if participations < 0:
        raise PrivacyError(f"participations must be >= 0, got participations={participations}")
    if min_sep < mechanism.bands:
        raise PrivacyError(f"min_sep={min_sep} is below the mechanism's bands={mechanism.bands}: the closed-form "
                           f"sensitivity needs participations at least bands steps apart")
    return math.sqrt(participations) * mechanism.max_column_norm


def min_sep_sensitivity(strategy: torch.Tensor, *, participations: int, min_sep: int) -> float:
    """``max_P sqrt(sum_{i,j in P} |G[i, j]|)``, ``G = C^T C``, over every set ``P`` of at most
    ``participations`` steps of ``C``'s ``n`` columns pairwise at least ``min_sep`` apart: an
    upper bound on the sensitivity, exact when ``G >= 0`` on the maximising set. Exhaustive
    (exponential in ``participations``): a reference for small ``n``, raising ``PrivacyError``
    above ``n = 64``."""
    n = strategy.shape[1]
    if n > 64:
        raise PrivacyError(f"min_sep_sensitivity enumerates participation sets: n={n} columns is too many (<= 64)")
    if min_sep < 1:
        raise PrivacyError(f"min_sep must be >= 1, got min_sep={min_sep}")
    gram = (strategy.to(torch.float64).T @ strategy.to(torch.float64)).abs().tolist()

    def search(chosen: tuple[int, ...], start: int) -> float:
        value = sum(gram[i][j] for i in chosen for j in chosen)
        if len(chosen) == participations:
            return value
        for nxt in range(start, n):
            value = max(value, search(chosen + (nxt,), nxt + min_sep))
        return value

    return math.sqrt(search((), 0))


def dense_strategy(mechanism: Mechanism, steps: int) -> torch.Tensor:
    """The ``steps x steps`` float64 matrix ``C`` of the mechanism."""
    return toeplitz_matrix(torch.tensor(mechanism.coefficients, dtype=torch.float64), steps)
