"""privacy.audit's f-DP bound (Mahloujifar, Melis, Chaudhuri 2024) on a mechanism whose privacy
curve is known exactly: membership scores ``mu * in + N(0, 1)`` are ``mu``-GDP per canary, and
thresholding them is the most powerful attack (Neyman-Pearson), so the audit sees the curve it
tests. Validity (a true claim is rejected no more often than the level) and power (a claim of
less leakage than the truth is rejected) are both checked over many simulated runs.
"""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from scipy import optimize

from privacy.audit import epsilon_lower_bound, fdp_epsilon_lower_bound, gaussian_mu, gdp_claim_rejected, guess_membership
from privacy.errors import PrivacyError

CANARIES, GUESSES, RUNS = 1000, 100, 100


def gdp_runs(mu: float, seed: int) -> list:
    """The guesses of ``RUNS`` audits of a ``mu``-GDP mechanism (top and bottom halves guessed)."""
    rng = np.random.default_rng(seed)
    runs = []
    for _ in range(RUNS):
        included = rng.random(CANARIES) < 0.5
        scores = mu * included + rng.standard_normal(CANARIES)
        runs.append(guess_membership(scores, included, top=GUESSES // 2, bottom=GUESSES - GUESSES // 2))
    return runs


def rejection_rate(runs: list, mu: float, level: float) -> float:
    return float(np.mean([gdp_claim_rejected(g.guesses, g.correct, canaries=CANARIES, mu=mu, level=level) > 0
                          for g in runs]))


@pytest.mark.parametrize("epsilon,delta", [(0.5, 1e-5), (2.0, 1e-5), (8.0, 1e-6), (1.0, 0.1)])
def test_gaussian_mu_is_the_gaussian_mechanisms(epsilon, delta):
    assert gaussian_mu(epsilon, delta) == pytest.approx(1 / dp_accounting.get_sigma_gaussian(epsilon, delta), rel=1e-6)


@pytest.mark.parametrize("mu,seed", [(1.0, 1), (2.0, 2)])
def test_a_true_gdp_claim_is_rejected_no_more_often_than_its_level(mu, seed):
    runs = gdp_runs(mu, seed)
    for level in (0.05, 0.5, 0.9):
        sd = (level * (1 - level) / RUNS) ** 0.5
        assert rejection_rate(runs, mu, level) <= level + 3 * sd, level
    # power: claiming 0.6 mu (less leakage than the truth) is caught at level 0.5 nearly always
    assert rejection_rate(runs, 0.6 * mu, 0.5) >= 0.9


def test_a_gdp_mechanisms_bound_stays_below_its_epsilon():
    delta, mu = 1e-5, 1.0
    true_epsilon = optimize.brentq(lambda e: gaussian_mu(e, delta) - mu, 0.0, 50.0)
    bounds = [fdp_epsilon_lower_bound(g.guesses, g.correct, canaries=CANARIES, delta=delta, confidence=0.95)
              for g in gdp_runs(mu, seed=3)[:30]]
    assert max(bounds) <= true_epsilon
    assert np.mean(bounds) > 0.3 * true_epsilon  # and it says something: not a vacuous 0


@pytest.mark.parametrize("guesses,correct", [(200, 137), (200, 150), (200, 200), (1000, 700)])
def test_fdp_is_tighter_than_the_one_run_bound(guesses, correct):
    kwargs = dict(canaries=1000, delta=1e-5, confidence=0.95)
    one_run = epsilon_lower_bound(guesses, correct, **kwargs)
    assert fdp_epsilon_lower_bound(guesses, correct, **kwargs) > one_run > 0


def test_fdp_bound_grows_with_right_guesses():
    bounds = [fdp_epsilon_lower_bound(100, v, canaries=500, delta=1e-5, confidence=0.95) for v in range(40, 101, 5)]
    assert bounds == sorted(bounds) and bounds[0] == 0.0 and bounds[-1] > 3


def test_the_overshoot_does_not_grow_with_mu():
    """The root search assumes it: a larger mu (a weaker claim) is never rejected more."""
    for guesses, correct in ((100, 70), (200, 150), (200, 200)):
        values = [gdp_claim_rejected(guesses, correct, canaries=1000, mu=mu, level=0.05)
                  for mu in np.linspace(0.01, 6.0, 60)]
        assert all(a >= b for a, b in zip(values, values[1:])), (guesses, correct)


def test_the_bound_is_the_root_where_the_claim_stops_being_rejected():
    guesses, correct, level, delta = 200, 150, 0.05, 1e-5
    e = fdp_epsilon_lower_bound(guesses, correct, canaries=1000, delta=delta, confidence=1 - level)
    below = gdp_claim_rejected(guesses, correct, canaries=1000, mu=gaussian_mu(e - 1e-6, delta), level=level)
    above = gdp_claim_rejected(guesses, correct, canaries=1000, mu=gaussian_mu(e + 1e-6, delta), level=level)
    assert below > 0 >= above


@pytest.mark.parametrize("kwargs,says", [
    (dict(delta=0.0), "delta"), (dict(delta=1.0), "delta"), (dict(confidence=1.0), "confidence"),
    (dict(correct=30, guesses=20), "correct <= guesses"),
])
def test_bad_fdp_settings_are_named_errors(kwargs, says):
    args = dict(guesses=100, correct=60, canaries=1000, delta=1e-5, confidence=0.95) | kwargs
    guesses, correct = args.pop("guesses"), args.pop("correct")
    with pytest.raises(PrivacyError, match=says):
        fdp_epsilon_lower_bound(guesses, correct, **args)
