"""Lower bounds on any schedule of given options on ``G`` devices (pure)."""

from __future__ import annotations

from typing import Mapping

from .plan import Options, useful_options


def makespan_lower_bound(options: Options, cluster_size: int) -> float:
    """The least ``C`` such that (1) every job has an option no longer than ``C`` and (2) the
    jobs' smallest device-seconds among options no longer than ``C`` sum to at most
    ``cluster_size * C``. Any schedule of makespan ``C`` satisfies both (each job runs one
    option within ``[0, C]``; at most ``G`` devices are busy at a time), so this is a lower
    bound on every schedule's makespan, the MILP's included.

    Edge cases: no jobs -> 0.0. (``property_tests/test_jobs_properties.py::test_plans_are_valid_and_never_worse_than_greedy``.)
    """
    if not options:
        return 0.0
    opts = {j: useful_options(o) for j, o in options.items()}
    floor = max(min(o.seconds for o in os_) for os_ in opts.values())
    breaks = sorted({o.seconds for os_ in opts.values() for o in os_ if o.seconds >= floor} | {floor})
    for k, c in enumerate(breaks):
        # on [c, next) each job's cheapest admissible area is constant: area(c)
        area = sum(min(o.devices * o.seconds for o in os_ if o.seconds <= c) for os_ in opts.values())
        candidate = max(c, area / cluster_size)
        if k + 1 == len(breaks) or candidate < breaks[k + 1]:
            return candidate
    raise AssertionError("unreachable: at the last breakpoint every job's fastest option is admissible")


def completion_lower_bound(options: Options, weights: Mapping[str, float] | None = None) -> float:
    """``sum_j w_j * (fastest option of j)``: every job ends no earlier than its fastest run."""
    return sum((weights or {}).get(j, 1.0) * min(o.seconds for o in os_) for j, os_ in options.items())
