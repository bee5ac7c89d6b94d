"""The privacy target is a budget across segments (issue 15, section 1): the planner's guarantees
on the accountant alone, then through ``fsdpx.train.run`` on a tiny model."""

import json
from pathlib import Path

import pytest
import torch

from fsdpx.train import RunConfig, run
from fsdpx.train.budget import (BudgetIncreaseError, SegmentDoesNotFitError, check_budget_change, segment_noise)
from privacy.accounting import NOISE_MULTIPLIER_RTOL, Accountant, max_steps, noise_multiplier

DELTA, Q = 1e-5, 0.04
COARSE = dict(accountant="pld", delta=DELTA, value_discretization_interval=1e-2)


def _ledger(*events, budget=None):
    return Accountant(events=tuple(events), epsilon_budget=budget, **COARSE)


def test_steps_that_fit_after_a_history_are_the_last_within_budget():
    spent = _ledger((0.8, Q, 20))
    fit = max_steps(1.2, Q, DELTA, 6.0, accountant="pld", value_discretization_interval=1e-2, history=spent.events)
    assert fit > 0
    assert spent.record(1.2, Q, fit).epsilon() <= 6.0 < spent.record(1.2, Q, fit + 1).epsilon()
    over = _ledger((0.5, Q, 200))
    assert over.epsilon() > 6.0
    assert max_steps(1.2, Q, DELTA, 6.0, accountant="pld", value_discretization_interval=1e-2,
                     history=over.events) == 0


def test_the_whole_history_ends_within_the_target():
    """20 steps calibrated for epsilon 8, then 10 more at another sample rate: the noise of the
    10 is the smallest (to 0.1%) that keeps the composition of all 30 within 8."""
    sigma0 = noise_multiplier(8.0, DELTA, Q, 20, accountant="pld", value_discretization_interval=1e-2)
    spent = _ledger((sigma0, Q, 20))
    sigma = segment_noise(spent, target=8.0, sample_rate=2 * Q, steps=10)
    assert spent.record(sigma, 2 * Q, 10).epsilon() <= 8.0
    assert spent.record(sigma / (1 + 2 * NOISE_MULTIPLIER_RTOL), 2 * Q, 10).epsilon() > 8.0


def test_an_unchanged_resume_keeps_the_current_noise_exactly():
    """Interrupted at step 10 of 20 and resumed with the same target: the noise the run was
    using already spends the budget to 0.1%, so it is kept, bit for bit."""
    sigma0 = noise_multiplier(8.0, DELTA, Q, 20, accountant="pld", value_discretization_interval=1e-2)
    assert segment_noise(_ledger((sigma0, Q, 10)), target=8.0, sample_rate=Q, steps=10, current=sigma0) == sigma0
    # fewer steps left than the noise was planned for: recalibrated to spend the budget
    fewer = segment_noise(_ledger((sigma0, Q, 10)), target=8.0, sample_rate=Q, steps=2, current=sigma0)
    assert fewer < sigma0


def test_a_segment_that_cannot_fit_names_the_steps_that_fit_and_the_noise_needed():
    spent = _ledger((1.0, Q, 100))
    with pytest.raises(SegmentDoesNotFitError, match=r"more step\(s\) fit at noise multiplier 1") as info:
        segment_noise(spent, target=spent.epsilon() + 0.5, sample_rate=Q, steps=2000, current=1.0, max_noise=3.0)
    err, target = info.value, spent.epsilon() + 0.5
    assert 0 < err.steps_fit < 2000 and err.current_noise == 1.0 and 3.0 < err.noise_needed < 1e6
    assert spent.record(1.0, Q, err.steps_fit).epsilon() <= target < spent.record(1.0, Q, err.steps_fit + 1).epsilon()
    assert f"need noise multiplier {err.noise_needed:.4g}" in str(err)
    with pytest.raises(SegmentDoesNotFitError, match="cannot fit at any noise") as info:
        segment_noise(spent, target=spent.epsilon() / 2, sample_rate=Q, steps=1, current=1.0)
    assert info.value.steps_fit == 0


def test_raising_the_target_needs_the_explicit_flag():
    spent = _ledger((1.0, Q, 10), budget=8.0)
    with pytest.raises(BudgetIncreaseError, match="--allow-budget-increase"):
        check_budget_change(spent, epsilon_budget=10.0, delta=DELTA, allow_increase=False)
    with pytest.raises(BudgetIncreaseError):
        check_budget_change(spent, epsilon_budget=None, delta=DELTA, allow_increase=False)  # no budget at all
    with pytest.raises(BudgetIncreaseError):
        check_budget_change(spent, epsilon_budget=8.0, delta=1e-3, allow_increase=False)  # a looser delta
    assert check_budget_change(spent, epsilon_budget=6.0, delta=1e-6, allow_increase=False).epsilon_budget == 6.0
    raised = check_budget_change(spent, epsilon_budget=10.0, delta=DELTA, allow_increase=True)
    assert raised.epsilon_budget == 10.0 and raised.events == spent.events


# --------------------------------------------------------------------------- through the run

TINY = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, corpus_chars=4000, batch_size=16.0, ckpt_every=2)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_refused_resume_names_what_fits_and_changes_nothing_on_disk(tmp_path):
    torch.set_num_threads(1)
    base = dict(out=str(tmp_path), name="r", ckpt_dir=str(tmp_path / "ck"), target_epsilon=3.0, **TINY)
    run(RunConfig.of(steps=6, **base), progress=False)
    before = _snapshot(tmp_path)
    with pytest.raises(SegmentDoesNotFitError, match=r"only \d+ more step\(s\) fit"):
        run(RunConfig.of(steps=400, resume=True, max_noise_multiplier=2.0, **base), progress=False)
    with pytest.raises(BudgetIncreaseError):
        run(RunConfig.of(steps=8, resume=True, **{**base, "target_epsilon": 4.0}), progress=False)
    assert _snapshot(tmp_path) == before


def test_raising_the_target_on_resume_is_recorded(tmp_path):
    torch.set_num_threads(1)
    base = dict(out=str(tmp_path), name="r", ckpt_dir=str(tmp_path / "ck"), **TINY)
    run(RunConfig.of(steps=4, target_epsilon=3.0, **base), progress=False)
    summary = run(RunConfig.of(steps=8, target_epsilon=4.0, resume=True, allow_budget_increase=True, **base),
                  progress=False)
    assert 3.0 < summary["epsilon"] <= 4.0
    segments = json.loads((tmp_path / "r" / "config.json").read_text())["segments"]
    assert [s["start_step"] for s in segments] == [0, 4]
    assert segments[1]["budget_changed_from"] == {"epsilon_budget": 3.0, "delta": 1e-5}
    assert segments[1]["config"]["privacy"]["target_epsilon"] == 4.0
    assert segments[1]["config"]["checkpoints"]["allow_budget_increase"]
