"""Empirical privacy auditing in one training run (Steinke, Nasr, Jagielski 2023): canaries in
with probability 1/2, one run, membership guesses from canary scores, and the epsilon lower
bound those guesses prove (and its f-DP refinement, Mahloujifar, Melis, Chaudhuri 2024),
beside the accountant's claim. See ``docs/architecture.md``."""

from privacy.audit.bound import correct_guess_p_value, epsilon_lower_bound
from privacy.audit.canaries import draw_membership
from privacy.audit.fdp_bound import fdp_epsilon_lower_bound, gaussian_mu, gdp_claim_rejected
from privacy.audit.guesses import Guesses, guess_membership
from privacy.audit.judge import audit_gradient_canaries, judge
from privacy.audit.report import AuditReport
from privacy.audit.run import audit_private_step

__all__ = [
    "AuditReport", "Guesses", "audit_gradient_canaries", "audit_private_step", "correct_guess_p_value", "draw_membership",
    "epsilon_lower_bound", "fdp_epsilon_lower_bound", "gaussian_mu", "gdp_claim_rejected", "guess_membership", "judge",
]
