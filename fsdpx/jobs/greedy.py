"""List schedules (pure): the greedy plan the MILP must beat, Saturn's two baselines, and the
placement of device ids.

A schedule here is a list of ``(job, option, start)``; ``place`` turns it into assignments
with concrete device ids.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .bounds import makespan_lower_bound
from .plan import Assignment, Option, Options, PlanError, useful_options

Scheduled = tuple[str, Option, float]


def _busy(placed: Sequence[Scheduled], at: float) -> int:
    return sum(o.devices for _, o, s in placed if s <= at < s + o.seconds)


def earliest_start(placed: Sequence[Scheduled], option: Option, cluster_size: int, not_before: float = 0.0) -> float:
    """The earliest time ``>= not_before`` at which ``option.devices`` devices stay free for
    ``option.seconds`` next to the ``placed`` jobs (backfilling: gaps before later jobs count).
    Always found: after every placed job ends, all devices are free."""
    if option.devices > cluster_size:
        raise PlanError(f"an option needs {option.devices} devices, the cluster has {cluster_size}")
    times = sorted({not_before, *(s + o.seconds for _, o, s in placed if s + o.seconds > not_before)})
    for t in times:
        end = t + option.seconds
        checks = [t, *(s for _, _, s in placed if t < s < end)]
        if all(_busy(placed, c) + option.devices <= cluster_size for c in checks):
            return t
    raise AssertionError("unreachable: the last end time leaves every device free")


def in_order(choices: Iterable[tuple[str, Option]], cluster_size: int) -> list[Scheduled]:
    """Each ``(job, option)`` in turn at its ``earliest_start`` next to the ones before it.

    Guarantee (used to compact the MILP's slot schedule): if the choices come sorted by the
    start times of a feasible schedule whose intervals contain the real ones, every job starts
    no later than there."""
    placed: list[Scheduled] = []
    for job, option in choices:
        placed.append((job, option, earliest_start(placed, option, cluster_size)))
    return placed


def earliest_finish(options: Options, cluster_size: int) -> list[Scheduled]:
    """Jobs by decreasing fastest runtime (ties: name), each given the useful option that
    finishes earliest next to the jobs placed before it (ties: fewer devices, technique)."""
    order = sorted(options, key=lambda j: (-min(o.seconds for o in options[j]), j))
    placed: list[Scheduled] = []
    for job in order:
        best = None
        for o in useful_options(options[job]):
            s = earliest_start(placed, o, cluster_size)
            key = (s + o.seconds, o.devices, o.technique)
            if best is None or key < best[0]:
                best = (key, o, s)
        placed.append((job, best[1], best[2]))
    return placed


def allotted(options: Options, cluster_size: int, deadline: float) -> list[Scheduled]:
    """Two-phase list schedule: each job takes its option of least device-seconds among those
    no longer than ``deadline`` (its fastest if none is), then jobs are placed longest first
    (ties: name) at their ``earliest_start``."""
    chosen = []
    for job in sorted(options):
        opts = useful_options(options[job])
        fit = [o for o in opts if o.seconds <= deadline] or [min(opts, key=lambda o: o.seconds)]
        chosen.append((job, min(fit, key=lambda o: (o.devices * o.seconds, o.seconds, o.technique))))
    return in_order(sorted(chosen, key=lambda c: (-c[1].seconds, c[0])), cluster_size)


DEADLINE_FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0)
"""Multiples of the lower bound tried as ``allotted``'s deadline."""


def greedy(options: Options, cluster_size: int, score=None) -> list[Scheduled]:
    """The greedy plan: the best by ``score`` (default: makespan; ties: the first) of
    ``earliest_finish`` and ``allotted`` at each of ``DEADLINE_FACTORS`` times the makespan
    lower bound -- the classic two-phase scheme for jobs whose speed depends on their device
    count. Deterministic, polynomial (about J^3 per candidate)."""
    if not options:
        return []
    score = score or makespan
    bound = makespan_lower_bound(options, cluster_size)
    candidates = [earliest_finish(options, cluster_size),
                  *(allotted(options, cluster_size, f * bound) for f in DEADLINE_FACTORS)]
    return min(candidates, key=score)


def one_after_another(options: Options, cluster_size: int) -> list[Scheduled]:
    """Saturn's first baseline: jobs one after another (name order), each on the largest device
    count it has an option for, with its fastest technique there."""
    t, out = 0.0, []
    for job in sorted(options):
        widest = max(o.devices for o in options[job])
        o = min((o for o in options[job] if o.devices == widest), key=lambda o: (o.seconds, o.technique))
        out.append((job, o, t))
        t += o.seconds
    return out


def equal_split(options: Options, cluster_size: int) -> list[Scheduled]:
    """Saturn's second baseline: every job gets ``max(1, G // J)`` devices (the smallest count
    it has an option for at or above that, or its largest), fastest technique there; jobs start
    in name order as devices free up."""
    share = max(1, cluster_size // max(1, len(options)))
    choices = []
    for job in sorted(options):
        counts = sorted({o.devices for o in options[job]})
        n = next((c for c in counts if c >= share), counts[-1])
        choices.append((job, min((o for o in options[job] if o.devices == n), key=lambda o: (o.seconds, o.technique))))
    return in_order(choices, cluster_size)


def makespan(schedule: Sequence[Scheduled]) -> float:
    return max((s + o.seconds for _, o, s in schedule), default=0.0)


def place(schedule: Sequence[Scheduled], cluster_size: int) -> tuple[Assignment, ...]:
    """Assignments with device ids: sweeping starts in time order (jobs ending at a time free
    their devices before jobs starting then take theirs), each job takes the lowest free ids.
    Raises :class:`PlanError` if the schedule ever needs more than ``cluster_size`` devices.

    Guarantee: jobs that overlap in time hold disjoint ids, each job exactly ``devices`` ids
    (``property_tests/test_jobs_properties.py::test_plans_are_valid_and_never_worse_than_greedy``)."""
    free = set(range(cluster_size))
    running: list[tuple[float, tuple[int, ...]]] = []
    out = []
    for job, o, s in sorted(schedule, key=lambda x: (x[2], x[0])):
        for end, ids in [r for r in running if r[0] <= s]:
            free |= set(ids)
        running = [r for r in running if r[0] > s]
        if len(free) < o.devices:
            raise PlanError(f"job {job!r} at {s:g} s needs {o.devices} devices, {len(free)} are free")
        ids = tuple(sorted(free)[: o.devices])
        free -= set(ids)
        running.append((s + o.seconds, ids))
        out.append(Assignment(job, o, s, ids))
    return tuple(out)
