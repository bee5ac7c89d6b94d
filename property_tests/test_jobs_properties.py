"""The multi-job planner on random synthetic instances (issue 13): runtimes with diminishing
returns in the device count, small counts memory-infeasible for some jobs."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings, strategies as st

from fsdpx.jobs.bounds import makespan_lower_bound, timeline_lower_bound
from fsdpx.jobs.greedy import greedy, in_order, makespan
from fsdpx.jobs.plan import Option, useful_options
from fsdpx.jobs.search import _Profile, improve
from fsdpx.jobs.solver import solve

FAST = settings(max_examples=12, deadline=None)


@st.composite
def instances(draw, max_jobs: int = 6):
    """``(options, G)``: per job, techniques x powers of two from a minimum count (smaller
    ones do not fit in memory), seconds = base * factor * (serial + (1 - serial) / n)."""
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))
    options = {}
    for j in range(draw(st.integers(1, max_jobs))):
        base = draw(st.floats(10, 1000))
        serial = draw(st.floats(0.0, 0.5))
        smallest = draw(st.sampled_from([n for n in (1, 2, 4) if n <= G]))
        counts = [n for n in (1, 2, 4, 8) if smallest <= n <= G]
        techs = draw(st.lists(st.tuples(st.sampled_from(["ddp", "zero2", "zero3"]), st.floats(1.0, 1.5)),
                              min_size=1, max_size=2, unique_by=lambda t: t[0]))
        options[f"job{j}"] = [Option(t, n, base * f * (serial + (1 - serial) / n)) for t, f in techs for n in counts]
    return options, G


@st.composite
def any_options(draw, max_jobs: int = 4):
    """``(options, G)`` with no speed-up law: 1-3 options per job, any count up to ``G``, seconds
    often whole (so patterns fill a makespan exactly and float ties are met)."""
    G = draw(st.integers(1, 5))
    seconds = st.one_of(st.integers(1, 12).map(float), st.floats(0.5, 12.0))
    options = {f"job{j}": draw(st.lists(st.builds(lambda g, s: Option("t", g, s), st.integers(1, G), seconds),
                                        min_size=1, max_size=3))
               for j in range(draw(st.integers(1, max_jobs)))}
    return options, G


def optimum(options, G) -> float:
    """The least makespan, by brute force: every choice of options in every order, list-scheduled
    (``in_order`` starts each job no later than any schedule with that start order does, so
    some order reaches the optimum)."""
    jobs = sorted(options)
    return min(makespan(in_order([(jobs[i], choice[i]) for i in perm], G))
               for choice in itertools.product(*(useful_options(options[j]) for j in jobs))
               for perm in itertools.permutations(range(len(jobs))))


def busy_devices(plan, at: float) -> int:
    return sum(a.option.devices for a in plan.assignments if a.start <= at < a.end)


@FAST
@given(instances())
def test_plans_are_valid_and_never_worse_than_greedy(instance):
    options, G = instance
    plan = solve(options, G, time_limit=1.0, slots=16)
    assert sorted(a.job for a in plan.assignments) == sorted(options)  # every job exactly once
    for a in plan.assignments:
        assert a.option in options[a.job] and a.start >= 0 and len(a.device_ids) == a.option.devices
        assert set(a.device_ids) <= set(range(G))
    for a in plan.assignments:  # capacity: checking every start suffices (usage only rises at starts)
        assert busy_devices(plan, a.start) <= G
        for b in plan.assignments:
            if a is not b and a.start < b.end and b.start < a.end:
                assert not set(a.device_ids) & set(b.device_ids)
    assert plan.makespan >= plan.lower_bound * (1 - 1e-9)
    assert plan.makespan <= makespan(greedy(options, G)) * (1 + 1e-9)
    assert plan.makespan <= plan.greedy_makespan * (1 + 1e-9)


@FAST
@given(instances())
def test_the_same_input_gives_the_same_plan(instance):
    options, G = instance
    first, second = solve(options, G, time_limit=5.0, slots=16), solve(options, G, time_limit=5.0, slots=16)
    assert first.assignments == second.assignments and first.lower_bound == second.lower_bound


@FAST
@given(instances())
def test_weighted_completion_is_never_worse_than_greedy(instance):
    options, G = instance
    weights = {j: 1.0 + i for i, j in enumerate(sorted(options))}
    plan = solve(options, G, objective="completion", weights=weights, time_limit=1.0, slots=16)
    greedy_score = sum(weights[j] * (s + o.seconds)
                       for j, o, s in greedy(options, G, lambda s: sum(weights[j] * (b + o.seconds) for j, o, b in s)))
    assert plan.weighted_completion(weights) <= greedy_score * (1 + 1e-9)
    assert plan.weighted_completion(weights) >= plan.lower_bound * (1 - 1e-9)


@FAST
@given(instances())
def test_pruning_keeps_a_dominating_option(instance):
    options, _ = instance
    for opts in options.values():
        kept = useful_options(opts)
        assert kept and all(k in opts for k in kept)
        for o in opts:
            assert any(k.devices <= o.devices and k.seconds <= o.seconds for k in kept)


@FAST
@given(instances(max_jobs=4))
def test_the_lower_bound_is_below_every_single_choice_schedule(instance):
    """Every fixed choice of options, list-scheduled, is a schedule: none beats the bound."""
    options, G = instance
    bound = makespan_lower_bound(options, G)
    jobs = sorted(options)
    for k in range(min(20, math.prod(len(options[j]) for j in jobs))):
        pick, rest = {}, k
        for j in jobs:
            pick[j], rest = options[j][rest % len(options[j])], rest // len(options[j])
        assert makespan(greedy({j: [pick[j]] for j in jobs}, G)) >= bound * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.one_of(instances(max_jobs=4), any_options()))
def test_the_timeline_bound_is_below_every_plan(instance):
    """The timeline bound is a lower bound: never above the exact optimum (brute force over
    every option choice and order of up to 4 jobs), and never below the area bound."""
    options, G = instance
    best = optimum(options, G)
    bound = timeline_lower_bound(options, G)
    assert makespan_lower_bound(options, G) <= bound <= best * (1 + 1e-9)
    assert timeline_lower_bound(options, G, upper=best) <= best * (1 + 1e-9)


@FAST
@given(instances())
def test_local_search_never_worsens_its_start(instance):
    """From any start order, the search returns every job once with one of its options, decoding
    to a makespan no longer than the start's; the same input gives the same order."""
    options, G = instance
    start = [(j, opts[-1]) for j, opts in sorted(options.items())]
    found = improve(options, start, G, budget=20_000)
    assert sorted(j for j, _ in found) == sorted(options) and all(o in options[j] for j, o in found)
    assert makespan(in_order(found, G)) <= makespan(in_order(start, G)) * (1 + 1e-9)
    assert found == improve(options, start, G, budget=20_000)


@FAST
@given(st.one_of(instances(max_jobs=8), any_options(max_jobs=8)), st.randoms(use_true_random=False))
def test_the_search_decodes_orders_as_in_order(instance, rnd):
    """The search's fast decoder (``search._Profile.place``) starts every job where
    ``greedy.in_order`` does, for any order and options."""
    options, G = instance
    order = [(j, rnd.choice(options[j])) for j in sorted(options)]
    rnd.shuffle(order)
    profile = _Profile()
    starts = [profile.place(o, G) for _, o in order]
    assert starts == [s for _, _, s in in_order(order, G)]
