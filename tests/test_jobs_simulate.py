"""The event simulation and re-planning (issue 13): ``fsdpx.jobs.simulate``."""

from __future__ import annotations

import pytest

from fsdpx.jobs.plan import Option
from fsdpx.jobs.simulate import Drift, Fail, Finish, simulate
from fsdpx.jobs.solver import solve

STEPS = {"a": 100, "b": 100, "c": 60, "d": 40}


def options():
    """Four jobs, each 1, 2 or 4 devices with diminishing returns; 1 s/step on one device x size."""
    size = {"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}
    return {j: [Option("zero3", n, STEPS[j] * size[j] * (0.2 + 0.8 / n)) for n in (1, 2, 4)] for j in STEPS}


def check_invariants(result, ckpt_every: int, fails: int = 0):
    segs = result.segments
    for x in segs:
        for y in segs:
            if x is not y and x.start < y.end - 1e-9 and y.start < x.end - 1e-9:
                assert not set(x.device_ids) & set(y.device_ids), (x, y)
    for job in STEPS:
        mine = sorted((s for s in segs if s.job == job), key=lambda s: s.start)
        assert mine[0].step_from == 0
        for prev, nxt in zip(mine, mine[1:]):
            # continues where it stopped, or (after a failure) at a checkpoint less than ckpt_every back
            assert prev.step_to - ckpt_every < nxt.step_from <= prev.step_to
        assert result.steps_done[job] == mine[-1].step_to
    assert sum(result.lost_steps.values()) <= fails * (ckpt_every - 1)


def test_without_events_the_simulation_runs_the_plan():
    plan = solve(options(), 4)
    result = simulate(options(), STEPS, 4, ckpt_every=10, plan=plan)
    assert result.replans[0].plan is plan and result.makespan == pytest.approx(plan.makespan) and len(result.replans) == 1
    assert result.steps_done == STEPS and result.lost_steps == {j: 0 for j in STEPS}
    check_invariants(result, 10)


def test_a_job_that_finishes_early_triggers_a_new_plan():
    result = simulate(options(), STEPS, 4, [Finish("a", 30)], ckpt_every=10)
    assert result.steps_done["a"] == 30 and result.steps_done["b"] == 100
    assert [r.reason for r in result.replans][1].startswith("a finished early at step 30")
    assert result.makespan < simulate(options(), STEPS, 4, ckpt_every=10).makespan
    check_invariants(result, 10)


def test_a_failed_job_loses_only_the_steps_after_its_last_checkpoint():
    plan = solve(options(), 4)
    first = plan.by_job()["a"]
    at = first.start + 0.37 * first.option.seconds  # mid-run, between checkpoints
    result = simulate(options(), STEPS, 4, [Fail("a", at)], ckpt_every=7, plan=plan)
    assert any(r.reason.startswith("a failed") for r in result.replans)
    assert 0 < result.lost_steps["a"] < 7 and result.steps_done == STEPS and result.ignored == ()
    idle = simulate(options(), STEPS, 4, [Fail("a", first.end + 1)], ckpt_every=7, plan=plan)
    assert idle.ignored == (Fail("a", first.end + 1),) and len(idle.replans) == 1
    check_invariants(result, 7, fails=1)


def test_drift_beyond_the_threshold_replans_and_within_it_does_not():
    at = 1.0
    big = simulate(options(), STEPS, 4, [Drift("a", at, 1.5)], ckpt_every=10, drift_threshold=0.2)
    small = simulate(options(), STEPS, 4, [Drift("a", at, 1.1)], ckpt_every=10, drift_threshold=0.2)
    assert any("drifted x1.5" in r.reason for r in big.replans)
    assert len(small.replans) == 1 and small.steps_done == STEPS
    # the re-plan saw the slower job: its new options are 1.5 times the profile for the steps left
    new = big.replans[1].plan.by_job()["a"].option
    left = STEPS["a"] - [s for s in big.segments if s.job == "a"][0].step_to
    base = {o.devices: o.seconds for o in options()["a"]}[new.devices]
    assert new.seconds == pytest.approx(1.5 * base * left / STEPS["a"])
    check_invariants(big, 10)
    check_invariants(small, 10)


def test_drift_of_a_job_not_yet_running_is_measured_when_it_starts():
    plan = solve(options(), 4)
    later = max(plan.assignments, key=lambda a: a.start)
    result = simulate(options(), STEPS, 4, [Drift(later.job, 0.5, 2.0)], ckpt_every=10, plan=plan)
    replan = next(r for r in result.replans if "drifted" in r.reason)
    assert replan.at > later.start
    check_invariants(result, 10)


def test_bad_events_are_named_errors():
    with pytest.raises(ValueError, match="unknown job"):
        simulate(options(), STEPS, 4, [Fail("zz", 1.0)])
    with pytest.raises(ValueError, match="factor"):
        simulate(options(), STEPS, 4, [Drift("a", 1.0, 0.0)])
