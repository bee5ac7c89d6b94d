"""privacy.audit end to end: Dirac canaries through the project's own private step.

Audits that can fail: a step built wrong on purpose (noise off; clipping out of reach) must be
caught, its lower bound above the epsilon the accountant claims for the run that was meant;
the real mechanism must stay below its claim.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.threads import one_thread  # noqa: F401 - autouse fixture

from fsdpx.optim import sgd
from privacy.audit import AuditReport, audit_private_step, draw_membership
from privacy.audit.canaries import canary_loss, canary_model, canary_rows, canary_scores
from privacy.errors import PrivacyError
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, init_state, make_private_step, sample_batch

# sigma 4, full batch, 4 steps: the accountant's epsilon at delta 1e-5 is 1.99
MEANT = DPConfig(clip_norm=1.0, noise_multiplier=4.0, sample_rate=1.0)
STEPS = 4


def test_membership_is_a_seeded_fair_draw():
    a, b = draw_membership(1000, seed=7), draw_membership(1000, seed=7)
    assert np.array_equal(a, b) and not np.array_equal(a, draw_membership(1000, seed=8))
    big = draw_membership(100_000, seed=1)
    assert abs(big.mean() - 0.5) < 5 * 0.5 / np.sqrt(big.size)  # five standard deviations


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_a_canary_moves_only_its_own_coordinate_by_its_clipped_norm(method):
    """One noiseless step of the real private step: an included canary's coordinate moves by
    ``min(norm, C) / (q N)`` (lr 1), every other coordinate stays exactly 0."""
    included = draw_membership(50, seed=3)
    data = canary_rows(included, norm=10.0)
    n = data[0].shape[0]
    config = DPConfig(clip_norm=2.0, noise_multiplier=0.0, sample_rate=1.0, method=method)
    model = canary_model(50)
    step = make_private_step(model, canary_loss, sgd(1.0), config, num_examples=n)
    state = init_state(dict(model.named_parameters()), sgd(1.0), key=0, config=config)
    before = state.params["weight"].clone()
    state, _ = step(state, sample_batch(data, PoissonSampler(n, 1.0, key=0), 0))
    scores = canary_scores(before, state.params["weight"])
    np.testing.assert_allclose(scores[included], 2.0 / n, rtol=1e-12)
    assert np.all(scores[~included] == 0.0)


def test_noise_off_exceeds_the_claim():
    run = DPConfig(clip_norm=1.0, noise_multiplier=0.0, sample_rate=1.0)
    report = audit_private_step(run, steps=STEPS, claimed=MEANT, seed=0)
    assert report.correct == report.guesses == 200
    assert report.epsilon_lower > report.claimed_epsilon == pytest.approx(1.993, abs=1e-3)
    assert report.verdict == "exceeds" and "EXCEEDS the claim" in str(report)


def test_broken_clipping_exceeds_the_claim():
    """Clipping out of reach (clip_norm 1e6) with the noise the meant run adds (std sigma * 1):
    the canaries' gradients (norm 10) pass unclipped, ten times the claimed sensitivity."""
    run = DPConfig(clip_norm=1e6, noise_multiplier=MEANT.noise_std / 1e6, sample_rate=1.0)
    assert run.noise_std == pytest.approx(MEANT.noise_std)
    report = audit_private_step(run, steps=STEPS, claimed=MEANT, seed=0)
    assert report.verdict == "exceeds" and report.epsilon_lower > report.claimed_epsilon + 1


def test_the_real_mechanism_stays_below_its_claim():
    """The meant run itself, over 5 seeds at 99% confidence: a correct step and accountant
    give a bound above the claim with probability <= 1% per seed (Theorem 5.2), so this
    deterministic test would fail for a random choice of seeds with probability <= 5%.
    Power: the audit still finds something (a bound above 0 on some seed)."""
    reports = [audit_private_step(MEANT, steps=STEPS, seed=s, confidence=0.99) for s in range(5)]
    assert all(r.verdict == "consistent" and r.epsilon_lower <= r.claimed_epsilon for r in reports), reports
    assert max(r.epsilon_lower for r in reports) > 0


def test_poisson_sampled_run_stays_below_and_noise_off_exceeds():
    """Sampling rate 0.5 over 8 steps (claimed epsilon 2.11): the sampler's batches go through
    the audit too; with the noise off, a canary never sampled scores like an absent one."""
    meant = DPConfig(clip_norm=1.0, noise_multiplier=3.0, sample_rate=0.5)
    real = audit_private_step(meant, steps=8, seed=11)
    assert real.verdict == "consistent"
    broken = audit_private_step(DPConfig(clip_norm=1.0, noise_multiplier=0.0, sample_rate=0.5), steps=8,
                                claimed=meant, seed=11)
    assert broken.verdict == "exceeds" and broken.epsilon_lower > broken.claimed_epsilon + 1, (real, broken)


def test_report_is_one_line_naming_both_epsilons():
    report = AuditReport(0.5, 0.95, 200, 137, 1.99, "consistent", 1000)
    assert str(report) == ("audit: epsilon >= 0.500 at 95% confidence (137/200 guesses right, 1000 canaries); "
                           "claimed epsilon 1.990: consistent with the claim")
    refined = AuditReport(0.5, 0.95, 200, 137, 1.99, "consistent", 1000, epsilon_lower_fdp=0.8)
    assert str(refined) == ("audit: epsilon >= 0.500 at 95% confidence (137/200 guesses right, 1000 canaries; "
                            ">= 0.800 if its privacy curve is Gaussian (f-DP)); claimed epsilon 1.990: consistent "
                            "with the claim")


def test_the_fdp_refinement_is_reported_beside_the_bound_and_is_tighter():
    report = audit_private_step(MEANT, steps=STEPS, seed=0)
    assert report.epsilon_lower_fdp is not None and report.epsilon_lower_fdp > report.epsilon_lower


def test_the_audit_is_deterministic():
    assert audit_private_step(MEANT, steps=2, seed=4) == audit_private_step(MEANT, steps=2, seed=4)


@pytest.mark.parametrize("kwargs", [dict(steps=0), dict(steps=2, guesses=0), dict(steps=2, guesses=1001)])
def test_bad_audit_settings_are_named_errors(kwargs):
    with pytest.raises(PrivacyError):
        audit_private_step(MEANT, **kwargs)


def test_an_accountant_told_a_smaller_sample_rate_is_caught():
    """The accounting side: a full-batch run (sigma 1, 4 steps) claimed as if sampled at rate
    0.02 (epsilon 0.62): the audit proves more than that."""
    run = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=1.0)
    told = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.02)
    report = audit_private_step(run, steps=STEPS, claimed=told, seed=0)
    assert report.verdict == "exceeds" and report.epsilon_lower > 2 * report.claimed_epsilon, report
