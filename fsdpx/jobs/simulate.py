"""Event simulation of a plan (``--simulate``): runs the plan from the profiles, applies events
and re-plans the remaining work, for cluster sizes this machine does not have (pure).

Execution rule: an assignment starts once its planned start has come and its device ids are
free (so a job that runs long delays the jobs planned on its devices, never overlaps them).
A job progresses, after its option's ``startup``, at ``(seconds - startup) / steps`` per step (times its
drift factor), checkpoints every
``ckpt_every`` completed steps and when it ends.

Events (each at a time ``at``, in seconds since the simulation began):

* ``Finish(job, at_step)``: the job stops early once it completes ``at_step`` steps (early
  stopping); the work left is re-planned at that moment.
* ``Fail(job, at)``: the job's processes die; it rolls back to its last checkpoint, its devices
  are freed and the work left (its lost steps included) is re-planned.
* ``Drift(job, at, factor)``: from ``at`` the job's steps take ``factor`` times the profile; once
  one step has been measured at the new rate, a drift beyond ``drift_threshold`` re-plans with
  the job's profile scaled by ``factor``.

A re-plan checkpoints every running job at its last completed step (the partial step is
redone) and restarts the jobs on their new assignment: no job loses completed steps except
to a failure, and then only those after its last checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from .plan import Option, Options, Plan
from .replan import drifted, replan as replan_left

EPS = 1e-9


@dataclass(frozen=True)
class Finish:
    job: str
    at_step: int


@dataclass(frozen=True)
class Fail:
    job: str
    at: float


@dataclass(frozen=True)
class Drift:
    job: str
    at: float
    factor: float


Event = Union[Finish, Fail, Drift]


@dataclass(frozen=True)
class Segment:
    """Job ``job`` ran ``option`` on ``device_ids`` over ``[start, end)`` seconds, completing its
    steps ``step_from + 1 .. step_to``."""

    job: str
    option: Option
    device_ids: tuple[int, ...]
    start: float
    end: float
    step_from: int
    step_to: int


@dataclass(frozen=True)
class Replan:
    at: float
    reason: str
    plan: Plan


@dataclass(frozen=True)
class SimResult:
    """The simulated run: its segments, the re-plans (the first at time 0), steps each job lost
    to failures, and when the last job ended."""

    segments: tuple[Segment, ...]
    replans: tuple[Replan, ...]
    lost_steps: dict[str, int]
    steps_done: dict[str, int]
    makespan: float
    ignored: tuple[Event, ...] = ()  # Fail events at a time their job was not running


@dataclass
class _Run:
    option: Option
    ids: tuple[int, ...]
    start: float
    t0: float  # progress reference time
    p0: float  # steps completed (fractional) at t0
    step_time: float

    def progress(self, t: float) -> float:
        return self.p0 + max(0.0, t - self.t0) / self.step_time


@dataclass
class _State:
    steps: dict[str, int]  # target per job (lowered by Finish)
    done: dict[str, int]
    ckpt: dict[str, int]
    factor: dict[str, float]
    lost: dict[str, int]
    every: dict[str, int]
    known: dict[str, float] = field(default_factory=dict)  # the drift factor measured so far
    assumed: dict[str, float] = field(default_factory=dict)  # the drift factor the current plan used
    watch: list = field(default_factory=list)  # (time, job): a step measured at a new rate is due
    running: dict[str, _Run] = field(default_factory=dict)
    pending: list = field(default_factory=list)
    segments: list = field(default_factory=list)


def simulate(options: Options, steps: Mapping[str, int], cluster_size: int, events: Sequence[Event] = (), *,
             ckpt_every: int | Mapping[str, int] = 50, drift_threshold: float = 0.2,
             solve_options: Mapping | None = None, plan: Plan | None = None) -> SimResult:
    """Plan ``options`` (each job's options for its full ``steps[job]`` steps) on
    ``cluster_size`` devices (or take ``plan``, one already solved for them), run the plan with
    ``events`` and re-plan as the module says (``solve(..., **solve_options)``).

    Guarantees (``tests/test_jobs_simulate.py``): segments overlapping in time hold disjoint
    device ids; every job ends with ``steps_done == steps`` (or its ``Finish`` step); a job's
    segments continue one another except after a ``Fail``, where it restarts at its last
    checkpoint (``lost_steps`` counts the difference, at most ``ckpt_every - 1`` per failure);
    with no events the makespan is the first plan's. Raises ``ValueError`` for an event naming
    an unknown job, a drift factor <= 0 or ``drift_threshold`` < 0.
    """
    for e in events:
        if e.job not in options:
            raise ValueError(f"event {e} names an unknown job")
        if isinstance(e, Drift) and not e.factor > 0:
            raise ValueError(f"drift factor must be > 0, got {e}")
    if drift_threshold < 0:
        raise ValueError(f"drift_threshold must be >= 0, got {drift_threshold}")
    every = {j: (ckpt_every if isinstance(ckpt_every, int) else ckpt_every.get(j, 50)) for j in options}
    st = _State(dict(steps), {j: 0 for j in options}, {j: 0 for j in options}, {j: 1.0 for j in options},
                {j: 0 for j in options}, every, known={j: 1.0 for j in options})
    for e in events:
        if isinstance(e, Finish):
            st.steps[e.job] = min(st.steps[e.job], e.at_step)
    timed = sorted((e for e in events if not isinstance(e, Finish)), key=lambda e: (e.at, e.job))
    replans: list[Replan] = []
    per_step = {j: {o: (o.seconds - o.startup) / steps[j] for o in os_} for j, os_ in options.items()}
    early = {e.job for e in events if isinstance(e, Finish)}

    def replan(t: float, reason: str, given: Plan | None = None) -> None:
        for job in list(st.running):
            _stop(st, job, t, checkpoint=True)
        left = {j: st.steps[j] - st.done[j] for j in options if st.done[j] < st.steps[j]}
        plan = given or replan_left(options, steps, left, cluster_size, factor=st.known, solve_options=solve_options)
        st.assumed = dict(st.known)
        st.watch = []
        replans.append(Replan(t, reason, plan))
        st.pending = sorted(((t + a.start, a.job, a.option, a.device_ids) for a in plan.assignments),
                            key=lambda x: (x[0], x[1]))

    replan(0.0, "start", plan)
    t, ignored = 0.0, []
    while st.pending or st.running:
        _start_ready(st, t, per_step)
        nxt = [(r.t0 + (st.steps[j] - r.p0) * r.step_time, "end", j) for j, r in st.running.items()]
        nxt += [(s, "start", j) for s, j, _, _ in st.pending if s > t + EPS]
        nxt += [(e.at, "event", e) for e in timed]
        nxt += [(w[0], "measure", w) for w in st.watch]
        if not nxt:
            raise AssertionError("simulation stalled: pending jobs can never start")  # capacity is planned
        when, kind, what = min(nxt, key=lambda x: (x[0], ["end", "event", "measure", "start"].index(x[1]), str(x[2])))
        t = max(t, when)
        if kind == "end":
            _stop(st, what, t, checkpoint=True)
            if what in early and st.done[what] >= st.steps[what] and (st.pending or st.running):
                replan(t, f"{what} finished early at step {st.done[what]}")
        elif kind == "event":
            timed.remove(what)
            if isinstance(what, Fail) and what.job in st.running:
                _stop(st, what.job, t, checkpoint=False)
                rolled = st.done[what.job] - st.ckpt[what.job]
                st.lost[what.job] += rolled
                st.done[what.job] = st.ckpt[what.job]
                replan(t, f"{what.job} failed at step {st.done[what.job] + rolled}, back to step {st.done[what.job]}")
            elif isinstance(what, Fail):
                ignored.append(what)
            elif isinstance(what, Drift):
                st.factor[what.job] = what.factor
                if what.job in st.running:
                    r = st.running[what.job]
                    r.p0, r.t0 = r.progress(t), max(t, r.t0)
                    r.step_time = per_step[what.job][_base(per_step[what.job], r.option)] * what.factor
                    st.watch.append((t + r.step_time, what.job))
        elif kind == "measure":
            st.watch.remove(what)
            job = what[1]
            if job not in st.running:
                continue
            st.known[job] = st.factor[job]
            ratio = st.known[job] / st.assumed[job]
            if drifted(st.known[job], st.assumed[job], drift_threshold):
                replan(t, f"{job} step time drifted x{ratio:g} from its profile (> {drift_threshold:g})")
    ignored += [e for e in timed if isinstance(e, Fail)]  # after every job ended
    makespan = max((s.end for s in st.segments), default=0.0)
    return SimResult(tuple(st.segments), tuple(replans), st.lost, st.done, makespan, tuple(ignored))


def _busy_ids(st: _State) -> set[int]:
    return {i for r in st.running.values() for i in r.ids}


def _start_ready(st: _State, t: float, per_step) -> None:
    busy = _busy_ids(st)
    for item in list(st.pending):
        s, job, option, ids = item
        if s <= t + EPS and not busy & set(ids):
            st.pending.remove(item)
            step_time = per_step[job][_base(per_step[job], option)] * st.factor[job]
            st.running[job] = _Run(option, ids, t, t + option.startup, float(st.done[job]), step_time)
            if st.factor[job] != st.known[job]:  # the first step at this rate will be measured
                st.watch.append((t + step_time, job))
            busy |= set(ids)


def _base(table: Mapping[Option, float], option: Option) -> Option:
    """The full-length option a re-planned (shortened) option came from."""
    return next(o for o in table if (o.technique, o.devices, o.params) == (option.technique, option.devices,
                                                                           option.params))


def _stop(st: _State, job: str, t: float, *, checkpoint: bool) -> None:
    r = st.running.pop(job)
    done = min(st.steps[job], math.floor(r.progress(t) + EPS))
    st.segments.append(Segment(job, r.option, r.ids, r.start, t, st.done[job], done))
    # a segment starts from a checkpoint; during it one is written every ``every`` steps
    periodic = done - done % st.every[job]
    st.ckpt[job] = done if checkpoint else max(st.ckpt[job], periodic)
    st.done[job] = done
