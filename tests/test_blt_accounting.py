"""A BLT mechanism in training: its ledger (one Gaussian mechanism at ``sigma / sens``, no
amplification claimed) against closed-form and exhaustive references, and the noise the private
step adds against the dense ``C^{-1} z`` oracle and the covariance ``C^{-1} C^{-T}``."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import optimize, stats

from privacy import DPConfig
from privacy.accounting import Accountant
from privacy.blt_sensitivity import cyclic_blt_sensitivity
from privacy.errors import PrivacyError
from privacy.mechanisms import (INDEPENDENT, BufferedToeplitz, blt_epsilon, blt_mechanism, blt_noise_multiplier, blt_sensitivity,
                                empty_history, min_sep_sensitivity, streamed_noise)
from privacy.mechanisms.toeplitz import toeplitz_matrix

from support.mechanism_step import steps_add_the_dense_noise
from support.threads import one_thread  # noqa: F401

STRATEGY = BufferedToeplitz((0.9, 0.3), (0.4, 0.2))
MECH = blt_mechanism(STRATEGY, min_sep=3)


@pytest.mark.parametrize("steps, min_sep", [(1, 1), (7, 1), (10, 3), (12, 4), (9, 9), (40, 6)])
def test_the_ledgers_sensitivity_is_the_blts(steps, min_sep):
    k = -(-steps // min_sep)
    want = blt_sensitivity(STRATEGY, steps, participations=k, min_sep=min_sep)
    assert cyclic_blt_sensitivity(STRATEGY.decays, STRATEGY.scales, steps, min_sep) == pytest.approx(want, rel=1e-12)
    if steps <= 12:  # the exhaustive maximum over every pattern of k participations min_sep apart
        exhaustive = min_sep_sensitivity(toeplitz_matrix(STRATEGY.coefficients(steps), steps), participations=k,
                                         min_sep=min_sep)
        assert want == pytest.approx(exhaustive, rel=1e-12)
    assert cyclic_blt_sensitivity((), (), steps, min_sep) == pytest.approx(math.sqrt(k), rel=1e-15)  # C = I
    with pytest.raises(PrivacyError, match="min_sep"):
        cyclic_blt_sensitivity(STRATEGY.decays, STRATEGY.scales, steps, 0)


def _analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Balle and Wang (2018), Theorem 8: the exact epsilon at ``delta`` of a Gaussian mechanism of
    sensitivity over noise ``mu``: the root of ``Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) = delta``."""
    def excess(eps):
        return stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps + stats.norm.logcdf(-mu / 2 - eps / mu)) - delta
    return optimize.brentq(excess, 0.0, 1e5, xtol=1e-12)


@pytest.mark.parametrize("sigma, steps", [(2.0, 10), (1.0, 4)])
def test_blt_epsilon_is_the_analytic_gaussian_at_sigma_over_the_sensitivity(sigma, steps):
    delta = 1e-5
    sens = cyclic_blt_sensitivity(MECH.decays, MECH.scales, steps, 3)
    exact = _analytic_gaussian_epsilon(sens / sigma, delta)
    got = blt_epsilon(sigma, MECH, steps, delta)
    assert exact <= got <= exact * (1 + 2e-3)  # PLD rounds pessimistically, by about its interval
    assert blt_epsilon(sigma, MECH, steps, delta, accountant="rdp") >= exact  # RDP: a looser upper bound
    assert blt_epsilon(sigma, MECH, 0, delta) == 0.0 and blt_epsilon(0.0, MECH, steps, delta) == math.inf
    tiny = 0.01 * sens  # multiplier 1/100: the RDP bound (a PLD would hold millions of points), still above exact
    assert _analytic_gaussian_epsilon(100.0, delta) <= blt_epsilon(tiny, MECH, steps, delta) < math.inf
    with pytest.raises(PrivacyError, match="kind 'blt'"):
        blt_epsilon(sigma, INDEPENDENT, steps, delta)


def test_blt_noise_multiplier_inverts_blt_epsilon():
    for target in (1.0, 8.0):
        sigma = blt_noise_multiplier(target, 1e-5, MECH, 20, value_discretization_interval=1e-2)
        eps = blt_epsilon(sigma, MECH, 20, 1e-5, value_discretization_interval=1e-2)
        assert (1 - 1e-3) * target <= eps <= target
    assert blt_noise_multiplier(1.0, 1e-5, MECH, 0) == 0.0


def test_a_blt_ledger_is_one_gaussian_at_sigma_over_the_sensitivity():
    acc = Accountant(delta=1e-5, value_discretization_interval=1e-2, **MECH.ledger_fields)
    ten = acc.record(2.0, 0.1, 10)
    assert ten.epsilon() == blt_epsilon(2.0, MECH, 10, 1e-5, value_discretization_interval=1e-2)
    assert ten.epsilon() == acc.record(2.0, 0.9, 10).epsilon()  # no amplification claimed: q does not enter
    # a resume or branch: the sensitivity of the total steps, however the segments split them
    assert acc.record(2.0, 0.1, 4).record(2.0, 0.1, 6).epsilon() == ten.epsilon()
    assert acc.record(2.0, 0.1, 12).epsilon() > ten.epsilon()  # one more participation of group 0
    mixed = acc.record(3.0, 0.1, 6).record(2.0, 0.1, 4)  # the smallest noise bounds every step's
    assert mixed.epsilon() == ten.epsilon() and acc.record(2.0, 0.1, 9).record(0.0, 0.1).epsilon() == math.inf
    assert Accountant.from_dict(ten.to_dict()) == ten and ten.to_dict()["blt"]["decays"] == [0.9, 0.3]
    assert not ten.is_dp_sgd and Accountant(delta=1e-5).is_dp_sgd
    with pytest.raises(PrivacyError, match="blt"):
        Accountant(delta=1e-5, blt=((0.5,), ()))


def test_the_step_adds_the_blts_noise(one_thread):
    """What the private step adds at step ``t`` is row ``t`` of the dense ``C^{-1} z`` times
    ``sigma * clip``, to 1e-12, and its history is the BLT's ``D`` buffers."""
    state, config = steps_add_the_dense_noise(MECH, torch.linalg.inv(toeplitz_matrix(STRATEGY.coefficients(5), 5)))
    assert len(state.noise_history) == 2 and state.noise_history[0].keys() == state.params.keys()
    assert state.accountant.blt == (MECH.decays, MECH.scales) and state.accountant.bands == 3
    assert DPConfig(**{**config.__dict__, "mechanism": MECH.to_dict()}) == config  # read back from a checkpoint


def test_blt_noise_has_the_covariance_of_the_inverse_strategy():
    n, numel, std = 5, 6_000, 2.0
    like, rows = {"p": torch.zeros(numel, dtype=torch.float64)}, []
    for key in range(4):
        history, out = empty_history(MECH), []
        for t in range(n):
            noise, history = streamed_noise(MECH, like, history, key=key, step=t, std=std)
            out.append(noise["p"])
        rows.append(torch.stack(out).T)
    samples = torch.cat(rows)  # (4 numel, n)
    inv = torch.linalg.inv(toeplitz_matrix(STRATEGY.coefficients(n), n))
    expected = std**2 * inv @ inv.T
    empirical = samples.T @ samples / samples.shape[0]
    tol = 5 * math.sqrt(2 / samples.shape[0]) * expected.diagonal().max().item()
    assert (empirical - expected).abs().max().item() < tol
    assert expected[1, 0].abs().item() > 5 * tol  # correlated: the test can tell it from I


def test_a_blt_segment_is_planned_on_its_ledger():
    """A resumed BLT run's remaining noise (``fsdpx.train.budget.segment_noise``) keeps the whole
    run's un-amplified epsilon within the target; more steps than any noise allows are refused."""
    from fsdpx.train.budget import SegmentDoesNotFitError, segment_noise

    spent = Accountant(delta=1e-5, value_discretization_interval=1e-2, **MECH.ledger_fields).record(3.0, 0.2, 6)
    target = 1.5 * spent.record(3.0, 0.2, 6).epsilon()
    sigma = segment_noise(spent, target=target, sample_rate=0.2, steps=6)
    assert sigma < 3.0 and target * (1 - 2e-3) <= spent.record(sigma, 0.2, 6).epsilon() <= target
    with pytest.raises(SegmentDoesNotFitError):  # the steps so far at 3.0 bound the rest: 400 more cannot fit
        segment_noise(spent, target=target, sample_rate=0.2, steps=400, max_noise=3.0)
