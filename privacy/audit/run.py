"""One audit, end to end: canaries drawn in, the project's private step run once, scores, bound.

The step is :func:`privacy.step.make_private_step` itself (its clipping, its noise, its
divisor, its optimizer update through ``fsdpx.optim.sgd``), on the Dirac canaries of
:mod:`privacy.audit.canaries` sampled by :class:`privacy.sampling.PoissonSampler`. What is
audited is the mechanism that ``run`` configures; what it is compared with is the epsilon the
accountant gives for ``claimed`` over the same steps, so a run built wrong on purpose (noise
off, clipping out of reach) can be held against the claim of the run that was meant.
"""

from __future__ import annotations

import numpy as np
import torch

from fsdpx.optim import sgd
from privacy.accounting import epsilon
from privacy.audit.canaries import canary_loss, canary_model, canary_rows, canary_scores, draw_membership
from privacy.audit.judge import judge
from privacy.audit.report import AuditReport
from privacy.errors import PrivacyError
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, init_state, make_private_step, sample_batch

CANARY_NORM_FACTOR = 10.0
"""A canary's gradient norm, in clip norms of the claim: a working clip cuts it to exactly the
sensitivity the claim assumes (the worst case a canary can be); a broken one lets ten times it
through."""


def audit_private_step(
    run: DPConfig, *, steps: int, claimed: DPConfig | None = None, canaries: int = 1000, guesses: int = 200,
    seed: int = 0, confidence: float = 0.95, canary_norm: float | None = None,
) -> AuditReport:
    """Train ``canaries`` Dirac canaries, each in with probability 1/2, for ``steps`` private
    steps of ``run``; guess "in" for the ``guesses // 2`` highest scores and "out" for the
    ``guesses - guesses // 2`` lowest; return the :class:`AuditReport` of the one-run bound
    (at ``claimed.delta``) and its f-DP refinement (``epsilon_lower_fdp``, which assumes a
    Gaussian privacy curve) beside the accountant's epsilon for ``claimed`` (default ``run``)
    over ``steps`` steps.

    Formal Guarantees (``tests/test_audit_run.py``): with probability at least ``confidence``
    over ``seed``'s draws, ``epsilon_lower`` is at most the run's true epsilon; so when ``run``
    is the mechanism ``claimed`` describes, the verdict is ``"consistent"`` except with
    probability ``1 - confidence`` (``test_the_real_mechanism_stays_below_its_claim``). With
    the noise off or the clipping out of reach, the canaries separate perfectly and the bound
    exceeds any claim below about ``log(guesses / log(1 / (1 - confidence)))``
    (``test_noise_off_exceeds_the_claim``, ``test_broken_clipping_exceeds_the_claim``).
    Deterministic: equal arguments give equal reports.

    Edge cases: ``steps < 1`` or ``guesses`` outside [1, canaries] -> :class:`PrivacyError`;
    ``claimed`` with noise 0 claims infinity, never exceeded; no canary drawn in ->
    :class:`PrivacyError` (take more canaries)."""
    claimed = run if claimed is None else claimed
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PrivacyError(f"audit steps must be an int >= 1, got steps={steps!r}")
    if not 1 <= guesses <= canaries:
        raise PrivacyError(f"audit guesses must be in [1, canaries={canaries}], got guesses={guesses}")
    included = draw_membership(canaries, seed=seed)
    data = canary_rows(included, norm=CANARY_NORM_FACTOR * claimed.clip_norm if canary_norm is None else canary_norm)
    scores = _train(run, data, canaries=canaries, steps=steps, seed=seed)
    claim = epsilon(claimed.noise_multiplier, claimed.sample_rate, steps, claimed.delta, accountant=claimed.accountant)
    return judge(scores, included, guesses=guesses, delta=claimed.delta, confidence=confidence, claimed_epsilon=claim)


def _train(run: DPConfig, data: tuple[torch.Tensor, torch.Tensor], *, canaries: int, steps: int, seed: int
           ) -> np.ndarray:
    """The canaries' scores after ``steps`` steps of ``run`` from a zero weight (SGD, lr 1:
    the scale of the scores does not change which are highest)."""
    model, optimizer = canary_model(canaries), sgd(1.0)
    num_examples = data[0].shape[0]
    sampler = PoissonSampler(num_examples=num_examples, sample_rate=run.sample_rate, key=seed)
    step = make_private_step(model, canary_loss, optimizer, run, num_examples=num_examples)
    params = dict(model.named_parameters())
    state = init_state(params, optimizer, key=seed, config=run)
    initial = state.params["weight"].clone()
    for t in range(steps):
        state, _ = step(state, sample_batch(data, sampler, t))
    return canary_scores(initial, state.params["weight"])
