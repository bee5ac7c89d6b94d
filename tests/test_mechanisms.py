"""Correlated-noise mechanisms (``privacy.mechanisms``): the strategy as data, its optimised
coefficients, its sensitivity, its regenerated noise and its epsilon, each against a reference
computation on small cases."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch

from privacy.errors import PrivacyError
from privacy.mechanisms import (INDEPENDENT, CyclicPoissonSampler, Mechanism, banded, banded_epsilon,
                                banded_noise_multiplier, banded_sensitivity, dense_strategy, empty_history,
                                min_sep_sensitivity, next_output, optimal_banded, prefix_sum_error, streamed_noise)
from privacy.mechanisms.correlated import history_after
from privacy.mechanisms.toeplitz import toeplitz_matrix
from privacy.noise import gaussian_noise, noise_slice
from privacy.sampling import PoissonSampler

from support.threads import one_thread  # noqa: F401

MECH = banded((0.8, 0.5, 0.3))


def test_toeplitz_matrix_holds_its_column_on_every_diagonal():
    c = (0.7, -0.2, 0.4, 0.1)
    strategy = toeplitz_matrix(torch.tensor(c, dtype=torch.float64), 12)
    for t in range(12):
        for k in range(12):
            assert strategy[t, k].item() == (c[t - k] if 0 <= t - k < len(c) else 0.0)
    assert toeplitz_matrix(torch.tensor(c, dtype=torch.float64), 2).tolist() == [[0.7, 0.0], [-0.2, 0.7]]


def test_a_normalised_column_is_kept_bit_for_bit():
    """Normalising is idempotent: a mechanism read back from its record (``to_dict`` /
    ``from_dict``, what a resume does) or built again from its own column is the same bits,
    for the column that changed by one ulp when it was scaled twice, and for 200 random ones."""
    g = torch.Generator().manual_seed(0)
    columns = [(1.0, 0.5)] + [tuple(torch.rand(int(torch.randint(2, 9, (1,), generator=g)), generator=g,
                                               dtype=torch.float64).add_(0.01).tolist()) for _ in range(200)]
    for column in columns:
        m = banded(column)
        assert Mechanism.from_dict(m.to_dict()) == m and banded(m.coefficients).coefficients == m.coefficients
        assert abs(math.fsum(x * x for x in m.coefficients) - 1.0) < 1e-15


def test_banded_columns_have_norm_at_most_one():
    m = banded((3.0, -4.0))
    assert m.coefficients == pytest.approx((0.6, -0.8)) and m.bands == 2
    norms = dense_strategy(m, 7).norm(dim=0)
    assert norms.max().item() == pytest.approx(1.0) and (norms <= 1 + 1e-15).all()
    assert banded((-1.0, 1.0)).coefficients[0] > 0
    for bad in ((), (0.0, 1.0), (math.nan,)):
        with pytest.raises(PrivacyError):
            banded(bad)
    with pytest.raises(PrivacyError, match="independent"):
        Mechanism("independent", (1.0, 0.5))
    with pytest.raises(PrivacyError, match="noise mechanism"):
        Mechanism("dense", (1.0,))
    with pytest.raises(PrivacyError, match="blt mechanism needs >= 1 buffer"):
        Mechanism("blt", (1.0,))
    with pytest.raises(PrivacyError, match="not 'banded'"):
        Mechanism("banded", (1.0, 0.5), decays=(0.5,), scales=(0.5,))
    assert Mechanism.from_dict(MECH.to_dict()) == MECH


def test_prefix_sum_error_equals_the_dense_product():
    n = 9
    c = torch.tensor(MECH.coefficients, dtype=torch.float64)
    b = torch.tril(torch.ones(n, n, dtype=torch.float64)) @ torch.linalg.inv(dense_strategy(MECH, n))
    assert prefix_sum_error(c, n, "total").item() == pytest.approx((b * b).sum().item(), rel=1e-12)
    assert prefix_sum_error(c, n, "max").item() == pytest.approx((b * b).sum(1).max().item(), rel=1e-12)
    assert prefix_sum_error(torch.ones(1), n).item() == pytest.approx(n * (n + 1) / 2)


def test_optimised_bands_beat_independent_noise_and_improve_with_bands():
    n = 32
    errors = [prefix_sum_error(torch.tensor(optimal_banded(b, n).coefficients), n).item() for b in (1, 2, 4, 8)]
    assert errors[0] == pytest.approx(n * (n + 1) / 2)
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert optimal_banded(4, n) == optimal_banded(4, n)  # deterministic
    assert optimal_banded(1, n) == INDEPENDENT and optimal_banded(50, 3).bands == 3
    maximum = optimal_banded(4, n, objective="max")
    assert prefix_sum_error(torch.tensor(maximum.coefficients), n, "max").item() <= \
        prefix_sum_error(torch.tensor(optimal_banded(4, n).coefficients), n, "max").item() + 1e-9


@pytest.mark.parametrize("participations,min_sep", [(1, 3), (2, 3), (3, 4), (4, 3)])
def test_banded_sensitivity_equals_the_brute_force_maximum(participations, min_sep):
    m = optimal_banded(3, 12)
    brute = min_sep_sensitivity(dense_strategy(m, 12), participations=participations, min_sep=min_sep)
    closed = banded_sensitivity(m, participations=participations, min_sep=min_sep)
    assert closed == pytest.approx(brute, rel=1e-12)
    assert closed == pytest.approx(math.sqrt(participations))


def test_overlapping_participations_have_no_closed_form_and_a_larger_brute_force_bound():
    m = optimal_banded(3, 12)
    with pytest.raises(PrivacyError, match="min_sep=2"):
        banded_sensitivity(m, participations=2, min_sep=2)
    # inside a band the columns overlap positively: sensitivity above sqrt(k)
    assert min_sep_sensitivity(dense_strategy(m, 12), participations=2, min_sep=1) > math.sqrt(2) + 0.1


def test_independent_mechanism_is_todays_noise():
    like = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    noise, history = streamed_noise(INDEPENDENT, like, (), key=7, step=3, std=1.5)
    assert history == () and empty_history(INDEPENDENT) == ()
    for name, t in gaussian_noise(like, key=7, step=3, std=1.5).items():
        assert torch.equal(noise[name], t)


def _streamed(mech, numel, steps, *, key, std=1.0, dtype=torch.float64):
    """Steps 0..steps-1 of one parameter ``p`` of ``numel`` elements, streamed from the empty history."""
    like, history, out = {"p": torch.zeros(numel, dtype=dtype)}, empty_history(mech), []
    for t in range(steps):
        noise, history = streamed_noise(mech, like, history, key=key, step=t, std=std)
        out.append(noise["p"])
    return torch.stack(out)  # (steps, numel)


@pytest.mark.parametrize("mech", [MECH, banded((0.5, -0.3)), banded((1.0, 0.9, 0.7, 0.2, 0.1))])
def test_streamed_noise_is_the_inverse_strategy_times_the_draws(mech):
    n, numel = 8, 50
    z = torch.stack([noise_slice("p", numel, 0, numel, key=11, step=k, std=1.0, dtype=torch.float64)
                     for k in range(n)])  # (n, numel)
    dense = torch.linalg.inv(dense_strategy(mech, n)) @ z
    torch.testing.assert_close(_streamed(mech, numel, n, key=11), dense, rtol=0, atol=1e-12)
    scaled = _streamed(mech, numel, n, key=11, std=0.7, dtype=torch.float32)
    assert scaled.dtype == torch.float32  # std times the float64 output, rounded once
    torch.testing.assert_close(scaled, (dense * 0.7).to(torch.float32), rtol=1e-6, atol=1e-7)


def test_a_frozen_step_restarts_a_parameters_history():
    w = {n: torch.full((2,), float(i)) for i, n in enumerate("abc")}
    history = history_after(2, {"a": [w["a"], w["b"]]})  # only a trained: b (frozen) is left out
    assert history == ({"a": w["a"]}, {"a": w["b"]})  # b was frozen: its history is gone
    assert history_after(1, {"a": [w["a"]], "b": [None]}) == ({"a": w["a"]},)
    assert history_after(0, {"a": []}) == ()
    with pytest.raises(PrivacyError, match="noise_history has 0 entries"):
        streamed_noise(MECH, {"p": torch.zeros(3)}, (), key=1, step=4, std=1.0)
    with pytest.raises(ValueError, match="at most 2"):
        next_output(MECH, torch.zeros(3), [None, None, None])


def test_streamed_noise_has_the_mechanisms_covariance():
    n, numel, std = 5, 6_000, 2.0
    samples = torch.cat([_streamed(MECH, numel, n, key=key, std=std).T for key in range(4)])
    # (4 numel, n): each element of each key one draw
    inv = torch.linalg.inv(dense_strategy(MECH, n))
    expected = std**2 * inv @ inv.T
    empirical = samples.T @ samples / samples.shape[0]
    # an entry's sampling sd is at most std^2 sqrt((S_ii S_jj + S_ij^2) / N); 5 sd of the largest
    tol = 5 * math.sqrt(2 / samples.shape[0]) * expected.diagonal().max().item()
    assert (empirical - expected).abs().max().item() < tol
    assert expected[1, 0].abs().item() > 5 * tol  # the test can see correlation: it is not I


def test_unamplified_banded_epsilon_is_one_gaussian_of_sensitivity_sqrt_k():
    # q = 1: every example of the active group, k = ceil(10 / 3) = 4 participations
    sigma, delta = 3.0, 1e-5
    got = banded_epsilon(sigma, 1.0, 10, 3, delta)
    sens = banded_sensitivity(optimal_banded(3, 10), participations=4, min_sep=3)
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.GaussianDpEvent(sigma / sens)).get_epsilon(delta)
    assert got == pytest.approx(reference, rel=2e-3)


def test_banded_epsilon_equals_dp_accounting_on_the_participations():
    sigma, q, delta, grid = 1.1, 0.1, 1e-5, 1e-3
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 7)  # ceil(25 / 4)
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=grid).compose(event).get_epsilon(delta)
    assert banded_epsilon(sigma, q, 25, 4, delta, value_discretization_interval=grid) == reference
    from privacy.accounting import epsilon
    assert banded_epsilon(sigma, q, 25, 1, delta, value_discretization_interval=grid) == \
        epsilon(sigma, q, 25, delta, value_discretization_interval=grid)
    found = banded_noise_multiplier(reference, delta, q, 25, 4, value_discretization_interval=grid)
    assert found == pytest.approx(sigma, rel=1e-2)
    assert banded_epsilon(found, q, 25, 4, delta, value_discretization_interval=grid) <= reference


def test_cyclic_sampler_keeps_participations_groups_apart():
    s = CyclicPoissonSampler(103, 0.5, key=5, groups=4)
    seen: dict[int, list[int]] = {}
    for t in range(40):
        idx = s.indices(t)
        assert torch.equal(idx, torch.unique(idx)) and bool(((idx % 4) == t % 4).all())
        for i in idx.tolist():
            seen.setdefault(i, []).append(t)
    gaps = [b - a for steps in seen.values() for a, b in zip(steps, steps[1:])]
    assert min(gaps) >= 4 and len(seen) > 90
    assert torch.equal(s.indices(9), CyclicPoissonSampler(103, 0.5, key=5, groups=4).indices(9))
    assert torch.equal(CyclicPoissonSampler(50, 0.3, key=1).indices(3), PoissonSampler(50, 0.3, key=1).indices(3))
    assert CyclicPoissonSampler.from_dict(s.to_dict()) == s and s.expected_batch_size == 0.5 * 25
    with pytest.raises(PrivacyError, match="groups"):
        CyclicPoissonSampler(3, 0.5, key=1, groups=4)
