"""Lower bounds on any schedule of given options on ``G`` devices (pure)."""

from __future__ import annotations

import math
import time
from typing import Mapping

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csc_array

from .plan import Option, Options, useful_options


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


def timeline_lower_bound(options: Options, cluster_size: int, upper: float | None = None, *,
                         tolerance: float = 1e-3, resolution: int = 4000, max_columns: int = 200,
                         deadline: float | None = None) -> float:
    """A lower bound on every schedule's makespan that knows a job cannot be split over time:
    each device runs its jobs one after another, so the seconds of the jobs on one device fit in
    the makespan.

    **Certificate.** Call a *pattern* for ``C`` a set of ``(job, option)``, at most one per job,
    whose seconds sum to at most ``C``. Take any weights ``mu_j >= 0`` and let ``v`` be the largest
    ``sum mu_j / g_o`` over patterns (``g_o`` the option's devices). In a schedule of makespan
    ``<= C`` every device runs a pattern (its jobs, once each, in disjoint intervals of
    ``[0, C]``), so summing ``mu_j / g_o`` over devices gives at most ``G v``; but every job
    runs on exactly ``g_o`` devices, so that sum is ``sum_j mu_j``. Hence ``sum_j mu_j > G v``
    proves that no schedule has makespan ``<= C``.

    **Rounding.** Seconds are counted in units of ``upper / resolution``, rounded *down*, and a
    capacity ``C`` in whole units, also down: a pattern that fits in ``C`` fits in the rounded
    capacity, so the rounded patterns are a superset and their largest value ``v`` is never
    below the true one -- every certificate stands. One knapsack pass (multiple choice: one
    option per job) gives ``v`` for every capacity at once, so one ``mu`` certifies every ``C``
    up to the last capacity where ``G v < sum mu``.

    **Finding weights.** ``mu`` are the optimal duals of the restricted configuration LP
    ``min sum_P z_P  s.t.  sum_P [j in P] z_P / g_{o(j,P)} >= 1  for every job j, z >= 0``
    (fractional device timelines covering each job) over rounded patterns, grown by column
    generation: the pattern of largest ``sum mu_j / g_o`` joins while that exceeds 1. It stops
    when ``mu`` certifies ``C``, when the LP covers every job with ``<= G`` timelines (no
    certificate at ``C`` from this LP), or after ``max_columns`` patterns.

    **Search.** Galloping from the area bound (:func:`makespan_lower_bound`, valid): test ``C``
    a step above the bound so far (first ``tolerance`` of it); a certificate raises the bound to
    the largest ``C`` its ``mu`` certifies and doubles the step, a failure makes that ``C`` the
    ceiling and halves the step (never testing past half-way to the ceiling; the first ceiling
    is ``upper``, default the jobs' fastest options one after another, a feasible makespan),
    until bound and ceiling are within ``tolerance``, or at ``deadline`` (a ``time.perf_counter()``
    value, checked after every LP: ``solve`` gives the bound a share of its time limit). The result
    is the largest certified ``C`` (or the area bound): each value is proven by its own
    certificate, so no step relies on monotonicity, and a search cut short by the deadline
    returns a valid, looser bound.

    Guarantee: ``<=`` the makespan of every schedule of these options on ``cluster_size``
    devices, and ``>=`` :func:`makespan_lower_bound`
    (``property_tests/test_jobs_properties.py::test_the_timeline_bound_is_below_every_plan``,
    against exhaustive optima for up to 4 jobs). Options dominated by another of the job's
    (``plan.useful_options``) are left out: swapping one for its dominator keeps a schedule
    feasible without lengthening it. Edge cases: no jobs -> 0.0; ``upper`` at or below the
    area bound -> the area bound.
    """
    lo = makespan_lower_bound(options, cluster_size)
    if not options:
        return lo
    opts = [useful_options(options[j]) for j in sorted(options)]
    hi = sum(min(o.seconds for o in os_) for os_ in opts) if upper is None else upper
    if hi <= lo:
        return lo
    unit = hi / resolution
    items = [[(o, int(math.floor(o.seconds / unit * (1 - 1e-9)))) for o in os_] for os_ in opts]
    patterns: list[tuple[tuple[int, Option, int], ...]] = [((j, o, w),) for j, its in enumerate(items) for o, w in its]
    step = tolerance * lo
    late = (lambda: time.perf_counter() >= deadline) if deadline is not None else (lambda: False)
    while hi - lo > tolerance * hi and not late():
        test = min(lo + step, (lo + hi) / 2) if step < hi - lo else (lo + hi) / 2
        certified = _certified_up_to(items, cluster_size, int(math.floor(test / unit)), patterns, max_columns, late)
        if certified is None:
            hi, step = test, (test - lo) / 2
        else:
            lo, step = max(lo, (certified + 1) * unit * (1 - 1e-9)), 2 * step
    return lo


def _certified_up_to(items: list[list[tuple[Option, int]]], G: int, capacity: int, patterns: list,
                     max_columns: int, late=lambda: False) -> int | None:
    """Column generation at a rounded ``capacity`` (``timeline_lower_bound``): the largest
    rounded capacity its final weights ``mu`` certify (``sum mu > G v``), or ``None`` if they do not
    certify ``capacity`` (or ``late()`` turned true first). ``patterns`` is a shared pool of
    ``(job, option, units)`` tuples; new patterns join it."""
    J = len(items)
    pool = [p for p in patterns if sum(w for _, _, w in p) <= capacity]
    if any(all(w > capacity for _, w in its) for its in items):
        return None  # a job no option of which fits: the area bound has this already
    for _ in range(max_columns):
        rows, cols, vals = [], [], []
        for c, pattern in enumerate(pool):
            for j, o, _ in pattern:
                rows.append(j); cols.append(c); vals.append(-1.0 / o.devices)
        A = csc_array((vals, (rows, cols)), shape=(J, len(pool)))
        res = linprog(np.ones(len(pool)), A_ub=A, b_ub=-np.ones(J), bounds=(0, None), method="highs")
        if res.status != 0:
            return None
        mu = np.maximum(-res.ineqlin.marginals, 0.0)
        value, best = _heaviest_patterns(items, mu, capacity)
        total = mu.sum() / (G * (1 + 1e-9))
        if total > value[capacity]:
            return int(np.searchsorted(value, total, side="left")) - 1  # value is non-decreasing
        if res.fun <= G * (1 + 1e-9) or value[capacity] <= 1 + 1e-9 or best in pool or late():
            return None
        pool.append(best)
        patterns.append(best)
    return None


def _heaviest_patterns(items: list[list[tuple[Option, int]]], mu: np.ndarray, capacity: int):
    """``(value, pattern)``: ``value[c]`` the largest ``sum mu_j / g_o`` over rounded patterns of
    at most ``c`` units, for every ``c`` (non-decreasing), and a pattern reaching
    ``value[capacity]`` within ``capacity`` units."""
    size = max(capacity, max(w for its in items for _, w in its)) + 1
    value = np.zeros(size)
    picks: list = []
    for j, its in enumerate(items):
        if mu[j] <= 0:
            picks.append(None)
            continue
        new, arg = value.copy(), np.full(size, -1)
        for k, (o, w) in enumerate(its):
            cand = np.full(size, -np.inf)
            cand[w:] = value[: size - w] + mu[j] / o.devices
            better = cand > new
            new[better], arg[better] = cand[better], k
        picks.append(arg)
        value = new
    c, pattern = capacity, []
    for j in reversed(range(len(items))):
        if picks[j] is not None and picks[j][c] >= 0:
            o, w = items[j][int(picks[j][c])]
            pattern.append((j, o, w))
            c -= w
    return value, tuple(sorted(pattern, key=lambda p: p[0]))
