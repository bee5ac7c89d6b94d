"""privacy.audit's bound: Theorem 5.2 of Steinke, Nasr, Jagielski 2023 turned into an epsilon.

The references here are computed independently: binomial tails as exact fractions from
``math.comb``, the root by plain bisection. The statistical test simulates an exactly eps-DP
randomized response and counts how often the bound claims more than eps.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from privacy.audit import correct_guess_p_value, epsilon_lower_bound, guess_membership
from privacy.errors import PrivacyError


def exact_tail(r: int, v: int, q: Fraction) -> Fraction:
    """P[Binomial(r, q) >= v], exactly."""
    return sum((math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(max(v, 0), r + 1)), Fraction(0))


def reference_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Theorem 5.2's right-hand side, term by term, in exact arithmetic (q rounded once)."""
    q = Fraction(math.exp(eps) / (1 + math.exp(eps)))
    f = exact_tail(r, v, q)
    best = max(((exact_tail(r, v - i, q) - f) / i for i in range(1, m + 1)), default=Fraction(0))
    return float(min(Fraction(1), f + 2 * m * Fraction(delta) * best))


def reference_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The supremum of the rejected epsilons, by bisection on the reference p-value."""
    level = 1 - confidence
    if v == 0 or reference_p_value(m, r, v, 0.0, delta) > level:
        return 0.0
    lo, hi = 0.0, 1.0
    while reference_p_value(m, r, v, hi, delta) <= level:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reference_p_value(m, r, v, mid, delta) <= level else (lo, mid)
    return lo


SMALL_CASES = [(12, 10, 9, 0.0), (12, 10, 10, 0.0), (20, 16, 15, 1e-3), (20, 20, 17, 1e-2), (8, 6, 6, 1e-3)]


@pytest.mark.parametrize("m,r,v,delta", SMALL_CASES)
def test_p_value_equals_the_theorem_computed_with_exact_fractions(m, r, v, delta):
    for eps in (0.0, 0.3, 1.0, 2.5):
        assert correct_guess_p_value(r, v, canaries=m, epsilon=eps, delta=delta) == pytest.approx(
            reference_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("m,r,v,delta", SMALL_CASES)
@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_bound_equals_a_brute_force_reference_on_small_cases(m, r, v, delta, confidence):
    got = epsilon_lower_bound(r, v, canaries=m, delta=delta, confidence=confidence)
    assert got == pytest.approx(reference_bound(m, r, v, delta, confidence), abs=1e-7)


def test_a_bound_with_every_guess_right_is_the_closed_form_at_delta_zero():
    # delta 0, all r right: q^r = 1 - confidence, so eps = logit((1 - confidence)^(1/r))
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, canaries=r, delta=0.0, confidence=0.95) == pytest.approx(
            math.log(q / (1 - q)), abs=1e-7)


def test_bound_is_monotone_in_correct_and_delta():
    r, m = 200, 1000
    bounds = [epsilon_lower_bound(r, v, canaries=m, delta=1e-5, confidence=0.95) for v in range(r + 1)]
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert bounds[r] > 4.0  # every guess right proves a lot ...
    assert bounds[r // 2] == 0.0  # ... a coin's half right proves nothing
    by_delta = [epsilon_lower_bound(r, 170, canaries=m, delta=d, confidence=0.95) for d in (0.0, 1e-6, 1e-4, 5e-4)]
    assert all(a >= b for a, b in zip(by_delta, by_delta[1:])) and by_delta[0] > by_delta[-1]
    by_confidence = [epsilon_lower_bound(r, 170, canaries=m, delta=1e-5, confidence=c) for c in (0.5, 0.9, 0.99)]
    assert by_confidence[0] > by_confidence[1] > by_confidence[2] > 0


def test_randomized_response_bound_stays_below_its_epsilon():
    """An exactly eps-DP randomized response of each canary's membership, guessed on every
    canary: by the theorem each run's bound exceeds eps with probability <= 5% at 95%
    confidence, independently across runs, so with a correct bound the count of runs that do
    reaches ``limit`` with probability below 1e-3 (the binomial tail, checked below). The bound
    must also have power: its mean is more than half of eps."""
    eps, m, runs, confidence = 1.0, 400, 300, 0.95
    limit = 29
    assert stats.binom.sf(limit - 1, runs, 1 - confidence) < 1e-3
    rng = np.random.default_rng(20231)
    over, bounds = 0, []
    for _ in range(runs):
        included = rng.integers(0, 2, size=m).astype(bool)
        truthful = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
        said = np.where(truthful, included, ~included)
        scores = said + 0.5 * rng.random(m)  # the response, ties broken by public coins
        counted = guess_membership(scores, included, top=m // 2, bottom=m - m // 2)
        bound = epsilon_lower_bound(*counted, canaries=m, delta=1e-5, confidence=confidence)
        over += bound > eps
        bounds.append(bound)
    assert over < limit, f"{over} of {runs} bounds exceeded the true epsilon {eps}"
    assert np.mean(bounds) > eps / 2


def test_guesses_count_the_right_ones():
    scores = np.array([5.0, -1.0, 3.0, 0.0, 0.0, 9.0])
    included = np.array([True, False, False, True, False, True])
    # top 2: canaries 5 (in, right) and 0 (in, right); bottom 2: 1 (out, right) and 4 (tie with
    # 3, the later index sorts last: out, right)
    assert guess_membership(scores, included, top=2, bottom=2) == (4, 4)
    assert guess_membership(scores, included, top=3, bottom=0) == (3, 2)  # canary 2 is out
    assert guess_membership(scores, included, top=0, bottom=0) == (0, 0)


@pytest.mark.parametrize("call", [
    lambda: epsilon_lower_bound(10, 11, canaries=20, delta=1e-5, confidence=0.95),
    lambda: epsilon_lower_bound(30, 10, canaries=20, delta=1e-5, confidence=0.95),
    lambda: epsilon_lower_bound(10, 8, canaries=20, delta=1e-5, confidence=1.0),
    lambda: epsilon_lower_bound(10, 8, canaries=20, delta=1.0, confidence=0.95),
    lambda: epsilon_lower_bound(10, 8, canaries=1000, delta=1e-3, confidence=0.95),  # 2 m delta = 2
    lambda: epsilon_lower_bound(10.0, 8, canaries=20, delta=1e-5, confidence=0.95),
    lambda: correct_guess_p_value(10, 8, canaries=20, epsilon=-1.0, delta=0.0),
    lambda: guess_membership(np.zeros(4), np.zeros(4, bool), top=3, bottom=2),
    lambda: guess_membership(np.array([0.0, np.nan]), np.zeros(2, bool), top=1),
    lambda: guess_membership(np.zeros(3), np.zeros(4, bool), top=1),
])
def test_bad_input_is_a_named_error(call):
    with pytest.raises(PrivacyError):
        call()
