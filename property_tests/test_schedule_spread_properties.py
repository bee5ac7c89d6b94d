"""Properties of ``fsdpx.sharding.schedule_spread.sampled_bubble``, the simulator run on durations
drawn from measured samples: without spread it is the simulation itself, its mean makespan stays
between the simulations at the samples' extremes, and its draws depend on the seed alone."""

import functools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.sharding.private_sim import simulate_private
from fsdpx.sharding.schedule_sim import simulate
from fsdpx.sharding.schedule_spread import sampled_bubble
from fsdpx.sharding.schedule import schedule as make_schedule
from property_tests.test_schedule_properties import schedules

KINDS_OF = ("F", "B", "W")
durations = st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False)


def keys(sched):
    return [(k, s) for k in KINDS_OF for s in range(sched.num_stages)]


@settings(max_examples=40, deadline=None)
@given(schedules(), st.data())
def test_one_sample_each_is_the_point_simulation(sched, data):
    one = {key: data.draw(durations) for key in keys(sched)}
    got = sampled_bubble(sched, {key: [v] for key, v in one.items()}, draws=3)
    point = simulate(sched, stage_costs=[{k: one[(k, s)] for k in KINDS_OF} for s in range(sched.num_stages)])
    assert got.mean == pytest.approx(point.bubble, abs=1e-12)
    assert got.quartiles == pytest.approx((point.bubble,) * 3, abs=1e-12)
    assert got.makespan == pytest.approx(point.makespan, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 4), st.integers(1, 8), st.data())
def test_one_sample_each_is_the_point_private_simulation(kind, p, m, data):
    sched = make_schedule(kind, p, m)
    one = {key: data.draw(durations) for key in keys(sched)}
    norms = data.draw(st.floats(0.0, 2.0))
    sim = functools.partial(simulate_private, norms=norms)
    got = sampled_bubble(sched, {key: [v] for key, v in one.items()}, draws=2, simulator=sim)
    point = sim(sched, stage_costs=[{k: one[(k, s)] for k in KINDS_OF} for s in range(sched.num_stages)])
    assert got.mean == pytest.approx(point.bubble, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(schedules(), st.data())
def test_mean_makespan_lies_between_the_extremes(sched, data):
    """``simulate`` runs each rank's list in a fixed order, so every action's start is a
    max-plus expression of the durations: non-decreasing in each of them."""
    samples = {key: data.draw(st.lists(durations, min_size=1, max_size=3)) for key in keys(sched)}
    got = sampled_bubble(sched, samples, draws=20, seed=data.draw(st.integers(0, 2**31)))
    at = lambda pick: simulate(sched, stage_costs=[{k: pick(samples[(k, s)]) for k in KINDS_OF}
                                                   for s in range(sched.num_stages)])
    assert at(min).makespan - 1e-9 <= got.makespan <= at(max).makespan + 1e-9
    assert 0.0 <= got.quartiles[0] <= got.quartiles[1] <= got.quartiles[2] < 1.0


@settings(max_examples=20, deadline=None)
@given(schedules(), st.integers(0, 2**31), st.data())
def test_draws_are_a_function_of_the_seed(sched, seed, data):
    samples = {key: data.draw(st.lists(durations, min_size=1, max_size=4)) for key in keys(sched)}
    assert sampled_bubble(sched, samples, draws=5, seed=seed) == sampled_bubble(sched, samples, draws=5, seed=seed)


def test_spread_durations_idle_more_than_their_means():
    """Jensen on a two-stage 1f1b: each action 1 or 3 (mean 2) idles more on average than
    every action at 2, which the medians' simulation would say."""
    sched = make_schedule("1f1b", 2, 8)
    spread = sampled_bubble(sched, {(k, s): [1.0, 3.0] for k in ("F", "B") for s in (0, 1)}, draws=400)
    point = simulate(sched, stage_costs=[{"F": 2.0, "B": 2.0, "W": 1.0}] * 2)
    assert spread.makespan > point.makespan * 1.03
    assert spread.mean > point.bubble


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draws_are_uniform_over_the_samples(seed):
    """One rank runs its 24 actions back to back: each draw's makespan is the sum of its drawn
    durations, whose mean over uniform draws from {1, 3} is 48 (standard error 0.25 at 400
    draws; the bound is six of them)."""
    sched = make_schedule("1f1b", 1, 8)
    got = sampled_bubble(sched, {(k, 0): [1.0, 3.0] for k in ("F", "B", "W")}, draws=400, seed=seed)
    assert got.makespan == pytest.approx(48.0, abs=1.5)
    assert got.mean == 0.0


def test_keys_without_samples_keep_the_simulators_costs():
    sched = make_schedule("gpipe", 2, 4)
    got = sampled_bubble(sched, {("F", 0): [2.0]}, draws=2, stage_costs=[{"F": 2.0, "B": 3.0, "W": 0.0},
                                                                          {"F": 1.0, "B": 3.0, "W": 0.0}])
    assert got.makespan == simulate(sched, stage_costs=[{"F": 2.0, "B": 3.0, "W": 0.0},
                                                        {"F": 1.0, "B": 3.0, "W": 0.0}]).makespan


@pytest.mark.parametrize("samples, draws, match", [
    ({("F", 0): [1.0]}, 0, "draws must be >= 1"),
    ({("B", 1): []}, 5, "no samples for B of stage 1"),
    ({("F", 0): [1.0, -1.0]}, 5, "finite and >= 0"),
    ({("W", 0): [math.nan]}, 5, "finite and >= 0"),
    ({("F", 1): [math.inf]}, 5, "finite and >= 0"),
])
def test_bad_samples_are_refused_by_name(samples, draws, match):
    with pytest.raises(ValueError, match=match):
        sampled_bubble(make_schedule("1f1b", 2, 4), samples, draws=draws)

