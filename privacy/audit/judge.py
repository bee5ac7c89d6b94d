"""From canary scores to an :class:`AuditReport`: the guesses, both bounds and the verdict."""

from __future__ import annotations

import numpy as np

from privacy.audit.bound import epsilon_lower_bound
from privacy.audit.fdp_bound import fdp_epsilon_lower_bound
from privacy.audit.guesses import guess_membership
from privacy.audit.report import AuditReport, verdict_of
from privacy.gradient_canaries import GradientCanaries

IN_RUN_GUESS_SHARE = 5
"""An in-run audit guesses on ``count // 5`` canaries (half "in", half "out"): the share the
standalone audit's defaults use (200 of 1000), chosen before any score is seen."""


def judge(scores: np.ndarray, included: np.ndarray, *, guesses: int, delta: float, confidence: float,
          claimed_epsilon: float) -> AuditReport:
    """Guess "in" for the ``guesses // 2`` highest ``scores`` and "out" for the rest of
    ``guesses`` lowest; return the one-run bound at ``delta`` and ``confidence`` (its verdict
    against ``claimed_epsilon``) with its f-DP refinement (None when ``delta == 0``).

    Formal Guarantees: the report of :func:`privacy.audit.audit_private_step` and of an in-run
    audit alike (``tests/test_audit_run.py``, ``tests/test_gradient_canaries.py``).
    Edge cases: as :func:`privacy.audit.guess_membership` and the bounds (named errors)."""
    top = guesses // 2
    counted = guess_membership(scores, included, top=top, bottom=guesses - top)
    canaries = int(np.asarray(scores).size)
    lower = epsilon_lower_bound(counted.guesses, counted.correct, canaries=canaries, delta=delta,
                                confidence=confidence)
    fdp = (None if delta == 0 else
           fdp_epsilon_lower_bound(counted.guesses, counted.correct, canaries=canaries, delta=delta,
                                   confidence=confidence))
    return AuditReport(lower, confidence, counted.guesses, counted.correct, claimed_epsilon,
                       verdict_of(lower, claimed_epsilon), canaries, fdp)


def audit_gradient_canaries(canaries: GradientCanaries, initial: np.ndarray, final: np.ndarray, *,
                            claimed_epsilon: float, delta: float, confidence: float = 0.95) -> AuditReport:
    """The audit of a run that trained ``canaries``: each canary's score is how far its
    coordinate moved down (``initial - final``: a joining canary adds ``+norm`` to the gradient
    sum, which every optimizer here turns into a step down), guesses on ``count // 5`` of them.

    Formal Guarantees (``tests/test_gradient_canaries.py``): with the run's noise the bound
    stays below the run's epsilon (``test_a_private_run_with_canaries_is_consistent``); with the
    noise off, the canaries separate and the bound exceeds the claim of the noise meant
    (``test_canaries_without_noise_exceed_the_claim``).
    Edge cases: ``initial``/``final`` not one value per canary -> :class:`PrivacyError`."""
    return judge(np.asarray(initial) - np.asarray(final), canaries.included,
                 guesses=max(1, canaries.count // IN_RUN_GUESS_SHARE), delta=delta, confidence=confidence,
                 claimed_epsilon=claimed_epsilon)
