"""The planner's solver on instances small enough to know the answer (issue 13)."""

from __future__ import annotations

import random
import time

import pytest

from fsdpx.jobs.bounds import completion_lower_bound, makespan_lower_bound, timeline_lower_bound
from fsdpx.jobs.greedy import equal_split, makespan, one_after_another, place
from fsdpx.jobs.plan import Option, PlanError
from fsdpx.jobs.solver import MARGIN, solve


def two_way(name: str) -> list[Option]:
    return [Option("ddp", 1, 10.0), Option("ddp", 2, 6.0)]


def test_two_jobs_on_two_devices_run_side_by_side():
    """Each job: 10 s on one device or 6 s on two. Side by side ends at 10 s; one after the
    other on both devices at 12 s. The bound is 10 (area 20 over 2 devices)."""
    options = {"a": two_way("a"), "b": two_way("b")}
    plan = solve(options, 2, time_limit=2.0)
    assert plan.makespan == pytest.approx(10.0) and plan.lower_bound == pytest.approx(10.0) and plan.gap == 0
    assert {a.device_ids for a in plan.assignments} == {(0,), (1,)}
    assert makespan(one_after_another(options, 2)) == pytest.approx(12.0)
    assert makespan(equal_split(options, 2)) == pytest.approx(10.0)


def test_the_milp_beats_greedy_where_list_scheduling_is_myopic():
    """Four jobs on 4 devices: the MILP finds a plan no worse than greedy and within 10% of the bound."""
    options = {f"j{i}": [Option("zero3", n, s / (0.2 + 0.8 / n) ** -1) for n in (1, 2, 4)]
               for i, s in enumerate((100.0, 80.0, 60.0, 40.0))}
    plan = solve(options, 4, time_limit=5.0)
    assert plan.makespan <= plan.greedy_makespan + 1e-9
    assert plan.makespan <= 1.10 * plan.lower_bound


def test_bad_problems_are_named_errors():
    with pytest.raises(PlanError, match="no option"):
        solve({"a": []}, 2)
    with pytest.raises(PlanError, match="more than 2 devices"):
        solve({"a": [Option("ddp", 4, 1.0)]}, 2)
    with pytest.raises(PlanError, match="seconds > 0"):
        Option("ddp", 1, 0.0)
    with pytest.raises(PlanError, match="needs 1 devices, 0 are free"):
        place([("a", Option("ddp", 2, 5.0), 0.0), ("b", Option("ddp", 1, 5.0), 0.0)], 2)


def test_no_jobs_is_an_empty_plan():
    plan = solve({}, 4)
    assert plan.assignments == () and plan.makespan == 0.0 and plan.lower_bound == 0.0


def test_lower_bounds_of_a_single_job():
    options = {"a": [Option("ddp", 1, 8.0), Option("ddp", 4, 3.0)]}
    assert makespan_lower_bound(options, 4) == pytest.approx(3.0)  # alone, its fastest run
    assert makespan_lower_bound(options, 1) == pytest.approx(8.0)
    assert completion_lower_bound(options, {"a": 2.0}) == pytest.approx(6.0)


def test_the_timeline_bound_knows_a_job_cannot_be_split_over_time():
    """Three 6 s one-device jobs on 2 devices: the area bound is 9 s (18 device-seconds over 2),
    but within less than 12 s a device runs at most one of them, so 2 devices cannot hold 3 --
    the timeline bound is 12 s (to its tolerance), which the plan reaches."""
    options = {f"j{i}": [Option("ddp", 1, 6.0)] for i in range(3)}
    assert makespan_lower_bound(options, 2) == pytest.approx(9.0)
    assert timeline_lower_bound(options, 2) == pytest.approx(12.0, rel=2e-3)
    assert timeline_lower_bound(options, 2) <= 12.0
    plan = solve(options, 2, time_limit=2.0)
    assert plan.makespan == pytest.approx(12.0) and plan.lower_bound == pytest.approx(12.0, rel=2e-3)


def irregular(jobs: int, cluster_size: int, seed: int = 0) -> dict[str, list[Option]]:
    """Options like a real jobs file's, profiled and predicted at every count: sizes over two
    orders of magnitude, 10 to 3000 steps, 40% private (ddp, zero2, zero3 with noise: 1.8-3x
    slower), a startup of 2-12 s, communication that grows with the count, and the larger jobs
    needing 2 devices under ddp. Unlike ``synthetic_options`` (powers of two, one shape), the
    seconds span 3 orders of magnitude, which is what made the MILP and the bound slow."""
    rng = random.Random(seed)
    out = {}
    for j in range(jobs):
        steps, size = rng.choice((10, 30, 100, 300, 1000, 3000)), rng.choice((0.01, 0.05, 0.2, 1.0))
        private, comm, startup = rng.random() < 0.4, size * rng.uniform(0.05, 0.5), rng.uniform(2, 12)
        opts = []
        for technique, slower, least in (("ddp", 1.0, 2), ("zero2", 1.1, 1), ("zero3", 1.3, 1)):
            factor = slower * (rng.uniform(1.8, 3.0) if private else 1.0)
            for n in range(1 if size < 0.2 else least, cluster_size + 1):
                step = size * factor / n + comm * (n - 1) / n + 0.001
                opts.append(Option(technique + "-private" * private, n, startup + steps * step, (), startup))
        out[f"j{j:02d}"] = opts
    return out


@pytest.mark.parametrize("jobs, devices, seed", [(24, 8, 0), (32, 16, 1)])
def test_the_planner_returns_within_its_time_limit(jobs, devices, seed):
    """Issue 28: ``solve(..., time_limit=8)`` took 16-46 s on irregular instances of 24-64 jobs
    (the search counted placements, the bound and the MILP's model build had no clock, and the
    MILP got at least a fifth of the limit whatever was left). Now every phase stops at its share
    of the limit, and the plan comes back within ``(1 + MARGIN)`` times it (1.5x).

    Wall time, not CPU time: the deadlines are on the wall clock (what the user waits for), so
    the wall time is what they bound; on a loaded machine the work in progress at a deadline
    stretches, which is what the margin is for. (Before the fix this instance took 2-4x the
    limit in wall time and more than the limit in CPU time alone, so either clock caught it.)"""
    options, limit = irregular(jobs, devices, seed), 3.0
    began = time.perf_counter()
    plan = solve(options, devices, time_limit=limit)
    took = time.perf_counter() - began
    assert took <= (1 + MARGIN) * limit, (took, plan.notes)
    assert plan.makespan <= plan.greedy_makespan * (1 + 1e-9) and plan.makespan >= plan.lower_bound * (1 - 1e-9)
