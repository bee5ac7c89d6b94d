"""Banded coefficients for the workload of SGD with momentum (``privacy.mechanisms.optimize``):
the workload is what the optimizer applies, its error is the dense product's, and coefficients
optimised for it serve it better than the prefix-sum ones (and are those at momentum 0)."""

from __future__ import annotations

import pytest
import torch

from fsdpx.optim import sgd
from privacy.errors import PrivacyError
from privacy.mechanisms import INDEPENDENT, banded, dense_strategy, optimal_banded, prefix_sum_error
from privacy.mechanisms.optimize import momentum_workload, optimal_banded_for_workload, workload_error
from privacy.mechanisms.toeplitz import toeplitz_matrix

from support.threads import one_thread  # noqa: F401


def test_momentum_workload_is_what_sgd_with_momentum_applies():
    n, lr, beta = 7, 0.3, 0.8
    grads = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    opt = sgd(lr, beta)
    params = {"x": torch.zeros(3, dtype=torch.float64)}
    state = opt.init(params)
    displaced = []
    for t in range(n):
        params, state = opt.update({"x": grads[t]}, state, params)
        displaced.append(params["x"])
    expected = -lr * toeplitz_matrix(momentum_workload(n, beta), n) @ grads
    assert torch.allclose(torch.stack(displaced), expected, rtol=1e-12, atol=1e-12)
    assert momentum_workload(n, 0.0).tolist() == [1.0] * n
    for bad in ((0, 0.5), (3, 1.0), (3, -0.1)):
        with pytest.raises(PrivacyError):
            momentum_workload(*bad)


def test_workload_error_equals_the_dense_product():
    n = 9
    mech = banded((0.8, 0.5, 0.3))
    c = torch.tensor(mech.coefficients, dtype=torch.float64)
    w = momentum_workload(n, 0.9)
    b = toeplitz_matrix(w, n) @ torch.linalg.inv(dense_strategy(mech, n))
    assert workload_error(c, w, "total").item() == pytest.approx((b * b).sum().item(), rel=1e-12)
    assert workload_error(c, w, "max").item() == pytest.approx((b * b).sum(1).max().item(), rel=1e-12)
    ones = torch.ones(n, dtype=torch.float64)
    assert workload_error(c, ones).item() == pytest.approx(prefix_sum_error(c, n).item(), rel=1e-12)
    with pytest.raises(PrivacyError, match="objective"):
        workload_error(c, w, "mean")


def test_momentum_optimised_bands_serve_momentum_better_than_prefix_sum_bands():
    n, bands = 48, 8
    w = momentum_workload(n, 0.9)
    tuned = workload_error(torch.tensor(optimal_banded_for_workload(bands, w).coefficients), w).item()
    prefix = workload_error(torch.tensor(optimal_banded(bands, n).coefficients), w).item()
    independent = workload_error(torch.ones(1), w).item()
    assert tuned < 0.98 * prefix < 0.98 * independent
    assert optimal_banded_for_workload(bands, w) == optimal_banded_for_workload(bands, w)  # deterministic
    assert optimal_banded_for_workload(1, w) == INDEPENDENT and optimal_banded_for_workload(60, w).bands == n


def test_momentum_zero_reproduces_the_prefix_sum_optimiser():
    n, bands = 32, 4
    mine = optimal_banded_for_workload(bands, momentum_workload(n, 0.0))
    theirs = optimal_banded(bands, n)
    assert mine.coefficients == pytest.approx(theirs.coefficients, abs=1e-5)
    assert prefix_sum_error(torch.tensor(mine.coefficients), n).item() <= \
        prefix_sum_error(torch.tensor(theirs.coefficients), n).item() * (1 + 1e-9)
