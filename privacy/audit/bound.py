"""The one-run epsilon lower bound: (guesses, correct) -> epsilon, Steinke, Nasr, Jagielski 2023.

"Privacy Auditing with One (1) Training Run" (NeurIPS 2023, arXiv 2305.08846): ``m`` canaries
are each included independently with probability 1/2, the model is trained once, and an auditor
who sees the output guesses the membership of ``r`` of them. If the training run is
``(epsilon, delta)``-DP with respect to each canary's inclusion, the number ``W`` of correct
guesses obeys (their Theorem 5.2), for every ``v``::

    P[W >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v].

So with ``v`` correct out of ``r``, every epsilon whose right-hand side is at most
``1 - confidence`` is rejected, and the supremum of the rejected epsilons is a lower bound on the
run's true epsilon that holds with probability ``confidence`` over the canaries' draw and the
run's randomness. The right-hand side increases with epsilon (a more private run makes many
correct guesses less likely), so the bound is the root of one monotone function.
"""

from __future__ import annotations

import math

import numpy as np

from privacy.errors import PrivacyError

# scipy is imported where it is used: scipy.stats takes 0.5-2 s to import, and a training
# process imports this module (fsdpx.train.loop) whether or not its run audits.
ROOT_TOLERANCE = 1e-9  # absolute tolerance of the epsilon root: far below any sampling error


def correct_guess_p_value(guesses: int, correct: int, *, canaries: int, epsilon: float, delta: float) -> float:
    """The probability, under an ``(epsilon, delta)``-DP run, of at least ``correct`` right
    guesses out of ``guesses`` on ``canaries`` canaries: Theorem 5.2's right-hand side, at most 1.

    Formal Guarantees: equals ``f(v) + 2 m delta max_i (f(v-i) - f(v)) / i`` with binomial tails
    computed by ``scipy.stats.binom.sf`` (``tests/test_audit_bound.py::
    test_p_value_equals_the_theorem_computed_with_exact_fractions``); non-decreasing in
    ``delta``; when ``2 m delta <= 1`` also non-decreasing in ``epsilon`` and non-increasing in
    ``correct`` (it is ``max_i (1 - c/i) f(v) + (c/i) f(v-i)`` with ``c = 2 m delta``: for
    ``i >= c`` both weights are >= 0 and every tail grows with epsilon), which is what makes the
    test of :func:`epsilon_lower_bound` one root with a stated level.

    Edge cases: ``correct == 0`` -> 1; ``delta == 0`` -> the binomial tail alone (pure DP);
    ``epsilon == inf`` -> 1 when ``correct <= guesses``; counts out of order
    (``0 <= correct <= guesses <= canaries``) or ``epsilon < 0`` or ``delta`` outside [0, 1]
    -> :class:`PrivacyError` naming them."""
    from scipy import special, stats

    check_counts(guesses, correct, canaries)
    if not epsilon >= 0:
        raise PrivacyError(f"epsilon must be >= 0, got epsilon={epsilon}")
    if not 0 <= delta <= 1:
        raise PrivacyError(f"delta must be in [0, 1], got delta={delta}")
    if correct == 0 or math.isinf(epsilon):
        return 1.0
    right = special.expit(epsilon)  # the accuracy of epsilon-DP randomized response
    tail = float(stats.binom.sf(correct - 1, guesses, right))  # f(v) = P[Bin >= v]
    if delta == 0:
        return tail
    # the theorem's max runs over i = 1..m; past i = v, f(v - i) = 1 and the ratio only falls
    shifts = np.arange(1, correct + 1)
    gains = (stats.binom.sf(correct - shifts - 1, guesses, right) - tail) / shifts  # (f(v-i) - f(v)) / i
    return min(1.0, tail + 2 * canaries * delta * float(np.max(gains)))


def epsilon_lower_bound(guesses: int, correct: int, *, canaries: int, delta: float, confidence: float) -> float:
    """The largest epsilon that ``correct`` right guesses out of ``guesses`` (on ``canaries``
    canaries) reject at ``confidence``: with probability at least ``confidence`` the run's true
    epsilon (at ``delta``) is at least the returned value.

    Formal Guarantees (``tests/test_audit_bound.py``): the returned ``e`` satisfies
    ``correct_guess_p_value(..., epsilon=e) == 1 - confidence`` to within ``ROOT_TOLERANCE``
    in epsilon, or is 0 when even epsilon 0 is not rejected
    (``test_bound_equals_a_brute_force_reference_on_small_cases``); non-decreasing in
    ``correct`` and in ``confidence``'s complement, non-increasing in ``delta``
    (``test_bound_is_monotone_in_correct_and_delta``); for an ``eps``-DP randomized response
    the bound exceeds ``eps`` in at most a ``1 - confidence`` fraction of runs
    (``test_randomized_response_bound_stays_below_its_epsilon``).

    Edge cases: ``correct == 0`` -> 0.0; ``correct <= guesses / 2`` (no better than a coin) ->
    0.0 at any ``confidence >= 1/2`` (a coin gets that many right with probability >= 1/2);
    every guess right -> finite (``r`` guesses cannot prove more than about
    ``log(r / log(1/(1-confidence)))``); ``confidence`` outside (0, 1), ``delta`` outside
    [0, 1), or ``2 * canaries * delta > 1`` -> :class:`PrivacyError` naming it."""
    from scipy import optimize

    check_counts(guesses, correct, canaries)
    if not 0 < confidence < 1:
        raise PrivacyError(f"confidence must be in (0, 1), got confidence={confidence}")
    if not 0 <= delta < 1:
        raise PrivacyError(f"delta must be in [0, 1), got delta={delta}")
    if 2 * canaries * delta > 1:
        raise PrivacyError(f"2 * canaries * delta must be <= 1 for the one-run bound (its p-value is monotone "
                           f"only then), got canaries={canaries}, delta={delta}: "
                           "take fewer canaries or a smaller delta")
    level = 1 - confidence

    def excess(eps: float) -> float:  # > 0 where eps is NOT rejected
        return correct_guess_p_value(guesses, correct, canaries=canaries, epsilon=eps, delta=delta) - level

    if excess(0.0) > 0:
        return 0.0
    high = 1.0
    while excess(high) <= 0:  # p-value -> 1 as epsilon -> inf, so this ends
        high *= 2
    return float(optimize.brentq(excess, 0.0, high, xtol=ROOT_TOLERANCE))


def check_counts(guesses: int, correct: int, canaries: int) -> None:
    """Raise :class:`PrivacyError` naming the count unless ``0 <= correct <= guesses <=
    canaries`` are ints (not bools); shared by every bound of :mod:`privacy.audit`."""
    for name, value in (("guesses", guesses), ("correct", correct), ("canaries", canaries)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise PrivacyError(f"{name} must be an int, got {name}={value!r}")
    if not 0 <= correct <= guesses <= canaries:
        raise PrivacyError(f"need 0 <= correct <= guesses <= canaries, got correct={correct}, "
                           f"guesses={guesses}, canaries={canaries}")
