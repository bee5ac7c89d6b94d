"""``solve``: the plan for a set of jobs -- the best of the greedy list schedule, the local search
(``search.py``) and the MILP (``milp.py``), never worse than greedy -- with a proven lower bound
(``bounds.timeline_lower_bound``)."""

from __future__ import annotations

import time
from typing import Mapping

from .bounds import completion_lower_bound, timeline_lower_bound
from .greedy import greedy, in_order, place
from .milp import solve_milp
from .plan import Options, Plan, check_options
from .search import BUDGET, improve


STAGES = ((0.5, 0.5), (2.0, 0.5))
"""MILP stages: (slots as a multiple of ``slots``, share of the MILP's seconds); the first with every
option, the later ones only with the options the best schedule so far and the previous stage chose."""

SEARCH_ENDS = 0.3
"""The first search stops (if its budget has not already) at this fraction of the time limit."""

BOUND_ENDS = 0.45
"""The lower bound stops refining at this fraction of the time limit (still a valid bound)."""

LAST_SEARCH = 0.1
"""The fraction of the time limit kept for the last search, after the MILP."""

MARGIN = 0.5
"""The most ``solve`` may take beyond its time limit, as a fraction of it, on a loaded 2-core
machine: the unit of work running at a deadline (one reinsertion of the search, one LP of the
bound, HiGHS' own check of its limit) and the steps that have none (greedy, placing the plan).
``tests/test_jobs_solver.py::test_the_planner_returns_within_its_time_limit`` holds it."""


def solve(options: Options, cluster_size: int, *, objective: str = "makespan",
          weights: Mapping[str, float] | None = None, time_limit: float = 5.0, slots: int = 48,
          use_milp: bool = True, search_budget: int = BUDGET) -> Plan:
    """The plan of ``options`` (``{job: [Option, ...]}``) on ``cluster_size`` devices, within
    ``time_limit`` wall seconds plus at most ``MARGIN`` of them.

    Runs the greedy list schedule; the search (``search.improve``, ``search_budget`` job
    placements, 0 for none) from it, until ``SEARCH_ENDS`` of the time limit at most; the lower
    bound, refined until ``BOUND_ENDS``; the MILP stages (``milp.py``, unless ``use_milp`` is
    false) in what is left but ``LAST_SEARCH``, warm-started from the best schedule so far and
    left-shifted; and the search again (a quarter of the budget, until the time limit) from the
    MILP's schedule when that is not the incumbent. Returns the schedule with the smallest
    objective, a later one only when strictly better. ``lower_bound`` bounds every schedule of
    these options (the timeline bound for the makespan); ``notes`` say what happened, and which
    phase the time limit cut short.

    Guarantees (``property_tests/test_jobs_properties.py``): every job appears exactly once
    with one of its options; at no time are more than ``cluster_size`` devices held, and
    jobs overlapping in time hold disjoint ids; objective <= greedy's; makespan >=
    ``lower_bound``; the same input gives the same plan when no phase is cut by the clock (the
    search ends by its budget, the bound by its tolerance, the MILP by optimality). Returns
    within ``(1 + MARGIN) * time_limit`` on a loaded machine
    (``tests/test_jobs_solver.py::test_the_planner_returns_within_its_time_limit``).
    Raises :class:`fsdpx.jobs.plan.PlanError` for a job with no option or an option wider
    than the cluster. No jobs: an empty plan.
    """
    check_options(options, cluster_size)
    start = time.perf_counter()
    at = lambda share: start + share * time_limit  # noqa: E731 - a point in time, by share of the limit
    score = (lambda s: max((b + o.seconds for _, o, b in s), default=0.0)) if objective == "makespan" else \
        (lambda s: sum((weights or {}).get(j, 1.0) * (b + o.seconds) for j, o, b in s))
    base = greedy(options, cluster_size, score)
    best, method, notes = base, "greedy", []

    def search_from(schedule, label: str, budget: int, deadline: float) -> None:
        nonlocal best, method
        order = improve(options, _start_order(schedule), cluster_size,
                        weights=(weights or {}) if objective == "completion" else None, budget=budget,
                        deadline=deadline)
        found = in_order(order, cluster_size)
        cut = " (cut by the time limit)" if time.perf_counter() >= deadline else ""
        notes.append(f"search from the {label} plan: {score(schedule):.6g} -> {score(found):.6g}{cut}")
        if score(found) < score(best) - 1e-9:
            best, method = found, f"{label}+search"

    searching = search_budget > 0 and len(options) > 1
    if searching:
        search_from(base, "greedy", search_budget, at(SEARCH_ENDS))
    if objective == "makespan":
        bound = timeline_lower_bound(options, cluster_size, upper=score(best), deadline=at(BOUND_ENDS))
        if time.perf_counter() >= at(BOUND_ENDS):
            notes.append("lower bound: refinement cut by the time limit (a looser bound)")
    else:
        bound = completion_lower_bound(options, weights)
    if use_milp and options:
        milp_ends = at(1.0 - LAST_SEARCH if searching else 1.0)
        milp_best = None
        # coarse to fine: all options on a coarse grid, then on a fine grid only the options the
        # best schedule so far and the coarse MILP chose (rounding costs less on a fine grid)
        coarse: tuple = ()
        for stage, (grid, share) in enumerate(STAGES):
            grid = max(4, round(grid * slots))
            # this stage's share of what is left of the MILP's seconds
            seconds = (milp_ends - time.perf_counter()) * share / sum(sh for _, sh in STAGES[stage:])
            if seconds <= 0:
                notes.append(f"MILP ({grid} slots): not run, the time limit is spent")
                continue
            incumbent = _start_order(best)
            pool = options if stage == 0 else _narrowed(options, incumbent, coarse)
            result = solve_milp(pool, cluster_size, incumbent, slots=grid, time_limit=seconds,
                                objective=objective, weights=weights)
            coarse = result.order if result is not None else ()
            if result is None:
                notes.append(f"MILP ({grid} slots): no feasible point within the time limit")
                continue
            shifted = in_order(result.order, cluster_size)
            notes.append(f"MILP: {result.variables} variables, {result.slots} slots of {result.delta:.4g} s, "
                         f"{'optimal on the grid' if result.optimal else result.message}")
            if milp_best is None or score(shifted) < score(milp_best) - 1e-9:
                milp_best = shifted
            if score(shifted) < score(best) - 1e-9:
                best, method = shifted, "milp"
        # the MILP's choices may lead the search elsewhere, unless it only gave back the incumbent
        if searching and milp_best is not None and (method == "milp" or _start_order(milp_best) != _start_order(best)):
            search_from(milp_best, "milp", search_budget // 4, at(1.0))
    greedy_makespan = max((b + o.seconds for _, o, b in base), default=0.0)
    return Plan(place(best, cluster_size), cluster_size, bound, method, greedy_makespan,
                time.perf_counter() - start, tuple(notes))


def _start_order(schedule) -> list:
    """A schedule's ``(job, option)`` by start (ties: name): the order ``greedy.in_order`` decodes."""
    return [(j, o) for j, o, _ in sorted(schedule, key=lambda x: (x[2], x[0]))]


def _narrowed(options: Options, *orders) -> dict[str, list]:
    """Per job, only the options some ``order`` (a sequence of ``(job, option)``) chose."""
    keep: dict[str, list] = {j: [] for j in options}
    for order in orders:
        for j, o in order:
            if o not in keep[j]:
                keep[j].append(o)
    return {j: keep[j] or list(options[j]) for j in options}
