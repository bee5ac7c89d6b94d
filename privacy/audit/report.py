"""An audit's outcome: the empirical epsilon lower bound beside the epsilon the accountant claims."""

from __future__ import annotations

from dataclasses import dataclass

EXCEEDS = "exceeds"  # the lower bound is above the claim: the run leaks more than it says
CONSISTENT = "consistent"  # the lower bound is at or below the claim (which proves nothing more)


@dataclass(frozen=True)
class AuditReport:
    """``epsilon_lower`` holds with probability ``confidence``; ``verdict`` compares it with
    ``claimed_epsilon`` (:data:`EXCEEDS` or :data:`CONSISTENT`, :func:`verdict_of`)."""

    epsilon_lower: float
    confidence: float
    guesses: int
    correct: int
    claimed_epsilon: float
    verdict: str
    canaries: int

    def __str__(self) -> str:
        head = (f"audit: epsilon >= {self.epsilon_lower:.3f} at {self.confidence:.0%} confidence "
                f"({self.correct}/{self.guesses} guesses right, {self.canaries} canaries); "
                f"claimed epsilon {self.claimed_epsilon:.3f}")
        if self.verdict == EXCEEDS:
            return head + ": EXCEEDS the claim, the run leaks more than its accountant says"
        return head + ": consistent with the claim"


def verdict_of(epsilon_lower: float, claimed_epsilon: float) -> str:
    """:data:`EXCEEDS` when ``epsilon_lower > claimed_epsilon``, else :data:`CONSISTENT` (an
    infinite claim is never exceeded)."""
    return EXCEEDS if epsilon_lower > claimed_epsilon else CONSISTENT
