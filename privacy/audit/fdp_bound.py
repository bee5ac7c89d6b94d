"""The one-run epsilon lower bound refined by f-DP: Mahloujifar, Melis, Chaudhuri 2024.

"Auditing f-Differential Privacy in One Run" (arXiv 2410.22235) tests a privacy *curve*
instead of one ``(epsilon, delta)`` pair. Here the curve is the Gaussian one: the claim
"``(epsilon, delta)``-DP" is read as "``mu``-GDP with the ``mu`` whose Gaussian mechanism is
exactly ``(epsilon, delta)``-DP" (:func:`gaussian_mu`). Under ``mu``-GDP a guess about one
canary that is right with probability mass ``x`` is wrong with mass at least
``Phi(Phi^-1(x) - mu)`` (the Gaussian trade-off function). Walking down from ``correct`` right
guesses to none, those per-canary limits add up to a least total guessing mass; when even that
exceeds the ``guesses`` the auditor made, observing ``correct`` right guesses with probability
``1 - confidence`` is impossible and the claim is rejected (:func:`gdp_claim_rejected`). The
bound is the largest epsilon rejected.

What it assumes, and so where it stands beside :mod:`privacy.audit.bound`: the Steinke-Nasr-
Jagielski bound holds for any ``(epsilon, delta)``-DP run; this one rejects the Gaussian curve
through ``(epsilon, delta)``, which is the curve of the Gaussian mechanism and close to DP-SGD's
after many steps, but a subsampled run's true curve can lie below it at other points. So it is
reported beside the assumption-free bound as the tighter estimate, and the audit's verdict
stays with the assumption-free one (:mod:`privacy.audit.report`).
"""

from __future__ import annotations

import math

from privacy.audit.bound import check_counts
from privacy.errors import PrivacyError

ROOT_TOLERANCE = 1e-9  # in epsilon and in mu, as privacy.audit.bound's


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The ``mu`` of the Gaussian mechanism (sensitivity 1, noise std ``1 / mu``) that is exactly
    ``(epsilon, delta)``-DP: the root of ``Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu -
    mu/2) = delta`` (Balle and Wang 2018), whose left side increases with ``mu``.

    Formal Guarantees: equals ``1 / dp_accounting.get_sigma_gaussian(epsilon, delta)`` to 1e-6
    (``tests/test_audit_fdp.py::test_gaussian_mu_is_the_gaussian_mechanisms``).
    Edge cases: ``epsilon < 0`` or ``delta`` outside (0, 1) -> :class:`PrivacyError`."""
    from scipy import optimize, stats

    if not epsilon >= 0 or math.isinf(epsilon):
        raise PrivacyError(f"epsilon must be finite and >= 0, got epsilon={epsilon}")
    if not 0 < delta < 1:
        raise PrivacyError(f"delta must be in (0, 1) for a Gaussian privacy curve, got delta={delta}")

    def excess(mu: float) -> float:
        return float(stats.norm.cdf(-epsilon / mu + mu / 2)
                     - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)) - delta

    low, high = 1e-12, 1.0
    while excess(high) < 0:
        low, high = high, 2 * high
    return float(optimize.brentq(excess, low, high, xtol=ROOT_TOLERANCE))


def gdp_claim_rejected(guesses: int, correct: int, *, canaries: int, mu: float, level: float) -> float:
    """How far ``correct`` right guesses out of ``guesses`` (on ``canaries`` canaries), seen with
    probability ``level``, overshoot what a ``mu``-GDP run allows: positive when the claim is
    rejected at ``level``, else <= 0.

    The walk (the paper's bound on the correct and wrong guessing mass, per canary): start from
    the mass ``level * correct / m`` right and ``level * (guesses - correct) / m`` wrong that
    the event itself carries; for ``i = correct - 1`` down to 0, the wrong mass must reach the
    trade-off ``Phi(Phi^-1(right) - mu)`` of the right mass, and each unit of wrong mass added
    at ``i`` right guesses brings ``i / (guesses - i)`` units of right mass with it (capped at
    1). The result is ``right + wrong - guesses / m``: the total mass the walk needs beyond
    what ``guesses`` guesses can carry.

    Formal Guarantees (``tests/test_audit_fdp.py``): non-increasing in ``mu``
    (``test_the_overshoot_does_not_grow_with_mu``); for a run that is
    ``mu``-GDP the rejection happens in at most a ``level`` fraction of runs
    (``test_a_gdp_mechanisms_bound_stays_below_its_epsilon``).
    Edge cases: ``correct == 0`` -> never rejected; counts out of order -> :class:`PrivacyError`."""
    from scipy import stats

    check_counts(guesses, correct, canaries)
    right, wrong = level * correct / canaries, level * (guesses - correct) / canaries
    for i in range(correct - 1, -1, -1):
        floor = float(stats.norm.cdf(stats.norm.ppf(right) - mu))
        if floor <= wrong:  # the trade-off is met: neither mass moves again
            break
        right = min(right + i / (guesses - i) * (floor - wrong), 1.0)
        wrong = floor
    return right + wrong - guesses / canaries


def fdp_epsilon_lower_bound(guesses: int, correct: int, *, canaries: int, delta: float, confidence: float
                            ) -> float:
    """The largest epsilon whose Gaussian privacy curve (through ``(epsilon, delta)``) the
    ``correct`` right guesses out of ``guesses`` reject at ``confidence``; 0.0 when none is.

    Formal Guarantees (``tests/test_audit_fdp.py``): over repeated runs of a ``mu``-GDP
    mechanism it exceeds that mechanism's epsilon at ``delta`` in at most about a
    ``1 - confidence`` fraction (``test_a_gdp_mechanisms_bound_stays_below_its_epsilon``);
    on the same guesses it is at least :func:`privacy.audit.bound.epsilon_lower_bound` in the
    regimes the paper reports (``test_fdp_is_tighter_than_the_one_run_bound``); non-decreasing
    in ``correct`` (``test_fdp_bound_grows_with_right_guesses``).
    Edge cases: ``correct <= guesses / 2`` -> 0.0; every guess right -> finite; ``delta``
    outside (0, 1) or ``confidence`` outside (0, 1) -> :class:`PrivacyError`."""
    from scipy import optimize

    check_counts(guesses, correct, canaries)
    if not 0 < confidence < 1:
        raise PrivacyError(f"confidence must be in (0, 1), got confidence={confidence}")
    if not 0 < delta < 1:
        raise PrivacyError(f"delta must be in (0, 1) for a Gaussian privacy curve, got delta={delta}")
    level = 1 - confidence

    def excess(eps: float) -> float:  # > 0 where eps IS rejected
        return gdp_claim_rejected(guesses, correct, canaries=canaries, mu=gaussian_mu(eps, delta), level=level)

    if correct == 0 or excess(0.0) <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while excess(high) > 0:  # mu -> inf as epsilon -> inf, and then nothing is rejected
        low, high = high, 2 * high
    return float(optimize.brentq(excess, low, high, xtol=ROOT_TOLERANCE))
