"""An audit's outcome: the empirical epsilon lower bound beside the epsilon the accountant claims."""

from __future__ import annotations

from dataclasses import dataclass

EXCEEDS = "exceeds"  # the lower bound is above the claim: the run leaks more than it says
CONSISTENT = "consistent"  # the lower bound is at or below the claim (which proves nothing more)


@dataclass(frozen=True)
class AuditReport:
    """``epsilon_lower`` holds with probability ``confidence`` for any run; ``verdict`` compares
    it with ``claimed_epsilon`` (:data:`EXCEEDS` or :data:`CONSISTENT`, :func:`verdict_of`).
    ``epsilon_lower_fdp`` is the tighter f-DP estimate from the same guesses, which assumes a
    Gaussian privacy curve (:mod:`privacy.audit.fdp_bound`): shown, not judged; None where the
    claim has ``delta == 0``."""

    epsilon_lower: float
    confidence: float
    guesses: int
    correct: int
    claimed_epsilon: float
    verdict: str
    canaries: int
    epsilon_lower_fdp: float | None = None

    def __str__(self) -> str:
        fdp = ("" if self.epsilon_lower_fdp is None
               else f"; >= {self.epsilon_lower_fdp:.3f} if its privacy curve is Gaussian (f-DP)")
        head = (f"audit: epsilon >= {self.epsilon_lower:.3f} at {self.confidence:.0%} confidence "
                f"({self.correct}/{self.guesses} guesses right, {self.canaries} canaries{fdp}); "
                f"claimed epsilon {self.claimed_epsilon:.3f}")
        if self.verdict == EXCEEDS:
            return head + ": EXCEEDS the claim, the run leaks more than its accountant says"
        return head + ": consistent with the claim"


def verdict_of(epsilon_lower: float, claimed_epsilon: float) -> str:
    """:data:`EXCEEDS` when ``epsilon_lower > claimed_epsilon``, else :data:`CONSISTENT` (an
    infinite claim is never exceeded)."""
    return EXCEEDS if epsilon_lower > claimed_epsilon else CONSISTENT
