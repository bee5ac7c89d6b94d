"""Buffered linear Toeplitz (BLT) strategies (``privacy.mechanisms.blt``): the strategy as data, its
noise streamed from ``D`` buffers, its min-separation sensitivity and its optimised parameters,
each against a dense or exhaustive reference on small cases."""

from __future__ import annotations

import math

import pytest
import torch

from privacy.errors import PrivacyError
from privacy.mechanisms import min_sep_sensitivity
from privacy.mechanisms.blt import (BufferedToeplitz, blt_error, blt_sensitivity, blt_step, empty_buffers,
                                    optimal_blt)
from privacy.mechanisms.toeplitz import toeplitz_matrix
from privacy.noise import noise_slice

from support.threads import one_thread  # noqa: F401

BLT = BufferedToeplitz((0.9, 0.3), (0.4, 0.2))


def test_blt_coefficients_are_the_geometric_sums():
    c = BLT.coefficients(6).tolist()
    assert c[0] == 1.0 and BLT.buffers == 2
    for j in range(1, 6):
        assert c[j] == pytest.approx(0.4 * 0.9 ** (j - 1) + 0.2 * 0.3 ** (j - 1), rel=1e-15)
    assert all(a >= b > 0 for a, b in zip(c, c[1:]))  # positive, non-increasing
    for decays, scales in [((0.5,), (0.3, 0.1)), ((1.0,), (0.5,)), ((0.0,), (0.5,)), ((0.5,), (-0.1,)),
                           ((0.5, 0.4), (0.6, 0.5)), ((math.nan,), (0.5,))]:
        with pytest.raises(PrivacyError):
            BufferedToeplitz(decays, scales)


def test_blt_noise_is_the_inverse_strategy_times_the_draws():
    n, numel = 8, 50
    z = torch.stack([noise_slice("p", numel, 0, numel, key=5, step=k, std=1.0, dtype=torch.float64)
                     for k in range(n)])
    dense = torch.linalg.inv(toeplitz_matrix(BLT.coefficients(n), n)) @ z
    buffers, block_buffers, rows = empty_buffers(BLT, z[0]), empty_buffers(BLT, z[0, 10:30]), []
    for t in range(n):
        w, buffers = blt_step(BLT, z[t], buffers)
        part, block_buffers = blt_step(BLT, z[t, 10:30], block_buffers)
        assert torch.equal(part, w[10:30])  # elementwise: any block is the whole's block, bit for bit
        rows.append(w)
    torch.testing.assert_close(torch.stack(rows), dense, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="1 buffers"):
        blt_step(BLT, z[0], buffers[:1])


@pytest.mark.parametrize("participations, min_sep", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 3)])
def test_blt_sensitivity_equals_the_brute_force_maximum(participations, min_sep):
    n = 10
    strategy = toeplitz_matrix(BLT.coefficients(n), n)
    want = min_sep_sensitivity(strategy, participations=participations, min_sep=min_sep)
    assert blt_sensitivity(BLT, n, participations=participations, min_sep=min_sep) == pytest.approx(want, rel=1e-12)
    assert blt_sensitivity(BLT, n, participations=0, min_sep=1) == 0.0
    with pytest.raises(PrivacyError, match="min_sep"):
        blt_sensitivity(BLT, n, participations=1, min_sep=0)


def test_optimised_blt_beats_independent_noise():
    n, k, sep = 16, 2, 8
    independent = k * n * (n + 1) / 2  # C = I: sensitivity^2 k, error n (n + 1) / 2
    start = blt_error(BufferedToeplitz((0.2, 0.9), (0.25, 0.25)), n, participations=k, min_sep=sep)  # its start
    found = optimal_blt(2, n, participations=k, min_sep=sep, iterations=40)
    error = blt_error(found, n, participations=k, min_sep=sep)
    assert error <= start and error < 0.6 * independent
    assert optimal_blt(2, n, participations=k, min_sep=sep, iterations=40) == found  # deterministic
    with pytest.raises(PrivacyError, match="buffers"):
        optimal_blt(0, n, participations=k, min_sep=sep)
