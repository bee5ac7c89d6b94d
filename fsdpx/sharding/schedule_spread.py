"""The bubble a schedule is expected to have when its actions' durations spread: the simulator
run many times on durations drawn from measured samples.

``simulate(schedule, stage_costs=medians)`` answers for one fixed set of durations. Measured
durations spread (other work on the host, the allocator, the caches), and a pipeline's makespan
is a max-plus function of them: each action starts at the later of its rank's previous action's
end and its input's arrival. A maximum of sums is convex, so by Jensen's inequality its mean over
spread durations is at least its value at the durations' means: the steps one measures idle more
than the medians' simulation says, the more so the wider the spread and the smaller the bubble
(two stages: a bubble of 0.12 moves by 10% when the makespan moves by 1.3%).

``sampled_bubble`` gives every ``F``, ``B`` and ``W`` of stage ``s`` a duration drawn
independently and uniformly from the samples of its kind and stage, runs the simulator, and
averages over the draws. Independence is the model's one assumption: a slowdown that hits every
rank at once (the whole host busier) costs no bubble but is drawn as if each rank met it alone,
so where such noise dominates the prediction is high; noise that slows one rank at a time is
what it describes. ``benchmarks/pipeline.py`` shows it beside the medians' simulation.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fsdpx.sharding.schedule import B, F, Schedule, W
from fsdpx.sharding.schedule_sim import Timeline, simulate

Samples = Mapping[tuple[str, int], Sequence[float]]  # (kind "F"/"B"/"W", stage) -> durations


@dataclass(frozen=True)
class SpreadBubble:
    """The simulated bubbles over ``draws`` draws: their mean and quartiles, and the mean makespan."""

    mean: float
    quartiles: tuple[float, float, float]
    makespan: float
    draws: int


def sampled_bubble(schedule: Schedule, samples: Samples, *, draws: int = 200, seed: int = 0,
                   simulator: Callable[..., Timeline] = simulate, **simulate_kwargs) -> SpreadBubble:
    """The mean and quartiles of ``simulator(schedule, action_costs=drawn, **simulate_kwargs)``'s
    bubble over ``draws`` draws, each compute action ``F``/``B``/``W`` of stage ``s`` lasting a
    duration drawn uniformly from ``samples[(kind, s)]``, independently (module docstring).

    ``simulator`` is ``simulate`` or one with its signature (``functools.partial(simulate_private,
    norms=...)``); ``simulate_kwargs`` (``rank_costs``, ``stage_costs``, ``transfer``, ``cores``)
    go to every call and cost what has no samples: transfers, and any kind and stage missing from
    ``samples``. The draws are a pure function of ``seed``.

    Guarantees (``property_tests/test_schedule_spread_properties.py``):
      * samples of one value each give exactly the simulation with those durations
        (``test_one_sample_each_is_the_point_simulation``);
      * the mean makespan lies between the simulations at every sample's minimum and maximum
        (``test_mean_makespan_lies_between_the_extremes``);
      * the same arguments give the same result (``test_draws_are_a_function_of_the_seed``).

    Raises ``ValueError`` for ``draws < 1``, an empty sample list (naming its key), or a
    negative or non-finite duration."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    pools = {key: _checked(key, values) for key, values in samples.items()}
    actions = [a for entries in schedule.ranks for a in entries
               if isinstance(a, (F, B, W)) and (type(a).__name__, a.stage) in pools]
    rng = random.Random(seed)
    bubbles, makespans = [], []
    for _ in range(draws):
        drawn = {a: rng.choice(pools[(type(a).__name__, a.stage)]) for a in actions}
        timeline = simulator(schedule, action_costs=drawn, **simulate_kwargs)
        bubbles.append(timeline.bubble)
        makespans.append(timeline.makespan)
    quartiles = tuple(statistics.quantiles(bubbles, n=4)) if draws > 1 else (bubbles[0],) * 3
    return SpreadBubble(mean=statistics.fmean(bubbles), quartiles=quartiles,
                        makespan=statistics.fmean(makespans), draws=draws)


def _checked(key: tuple[str, int], values: Sequence[float]) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"no samples for {key[0]} of stage {key[1]}: leave the key out to cost it by the simulator's costs")
    bad = [v for v in values if not (v >= 0 and v != float("inf"))]
    if bad:
        raise ValueError(f"durations of {key[0]} of stage {key[1]} must be finite and >= 0, got {bad[:3]}")
    return values
