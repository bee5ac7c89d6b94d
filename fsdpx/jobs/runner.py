"""Executing a plan for real (``fsdpx jobs run``): every job an attempt on its device group,
re-planned on events (the impure edge of the planner).

Devices: a plan's device ids ``0..G-1`` map to GPUs ``0..G-1``, or on a CPU to the cores this
process may use, device ``i`` on core ``cores[i % len(cores)]`` -- one core per device when
``G <= cores``; with more devices than cores a device is a slot and slots share cores.

Start rule: a job starts as soon as every job the plan placed before it on any of its devices
(its predecessors in the device order: earlier planned start, ties by name) has ended -- not at
its planned time, which real durations make stale. Two jobs never hold a device at once, and
no job waits for a device that is free.

Events (each re-plans the work left with ``replan.replan``, the function the simulation uses):

* a job fails (its technique raises in ``execute``, or its process group exits non-zero): it
  is reported failed with its error (or retried from its last checkpoint while it has
  ``retries`` left); the others go on;
* a job finishes early: it ends ``early`` (a fraction of its planned duration, at least
  ``EARLY_SECONDS``) before its planned end;
* a job drifts: its measured seconds per step, over a window of at least ``DRIFT_STEPS`` steps
  and ``DRIFT_SECONDS`` seconds of the running attempt (after its first step, a warm-up), is
  ``factor`` times its profile and ``replan.drifted(factor, assumed, drift_threshold)`` -- the
  simulation's rule: the work left is re-planned with the job's options scaled by ``factor``
  (every later re-plan keeps it), and the plan then assumes ``factor``, so the same pace never
  re-plans twice. Steps are timed by the job's own clock (``elapsed_seconds`` in its metrics, as the
  built-ins log it), else by when the runner saw them.

A re-plan keeps a running job where it is when the new plan gives it the same choice now;
every other running job is moved by checkpoint-and-restart: its processes are killed and it
starts again, from its newest checkpoint, on its new devices (losing the steps after that
checkpoint: at most ``ckpt_every - 1``). A job resumed from a checkpoint continues bit for bit
with the same technique and device count; with another count (or technique), within float
rounding (``tests/test_jobs_run.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from .backends import Attempt, Handle, LocalBackend, outcome_of
from .devices import Devices, physical_ids
from .live import LiveTable, Row, checkpoint_step, format_table, read_progress
from .plan import Assignment, Option, Options, Plan
from .replan import Running, drifted, profiled_step, replan, stays
from .solver import solve
from .task import Task, check_unique_names
from .techniques import check_runnable

EARLY_SECONDS = 1.0
"""A job ending less than this before its planned end is on time (no re-plan)."""

DRIFT_STEPS = 3
DRIFT_SECONDS = 2.0
"""A pace is measured over at least this many steps and seconds. On the runner's clock both ends
of the window are seen up to one ``poll`` late, so the window's length is off by at most one
poll: 10% of 2 s at the default 0.2 s, half the default threshold."""


@dataclass(frozen=True)
class RunSegment:
    """Job ``job`` ran ``technique`` on ``devices`` (plan ids) over ``[start, end)`` seconds of
    the run, from step ``step_from``; it ended ``how`` ("done", "failed" or "moved") at step
    ``step_to`` (its last logged step)."""

    job: str
    technique: str
    devices: tuple[int, ...]
    start: float
    end: float
    step_from: int
    step_to: int
    how: str


@dataclass(frozen=True)
class Replan:
    """A plan made at ``at`` seconds for ``reason``, the running jobs it ``moved``, and the pace
    ``factors`` (measured step time over the profile's) it assumed for drifted jobs."""

    at: float
    reason: str
    plan: Plan
    moved: tuple[str, ...] = ()
    factors: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended: ``state`` "done" or "failed", its ``error``, what ``execute`` returned
    last (``result``), and its segments in order."""

    name: str
    state: str
    error: str | None
    result: Any
    segments: tuple[RunSegment, ...]


@dataclass(frozen=True)
class RunReport:
    """The run: every job's outcome, the plans (the first at time 0), the first plan's
    makespan (``predicted``) and the measured one (``makespan``: seconds from the first start
    to the last end)."""

    jobs: dict[str, JobOutcome]
    replans: tuple[Replan, ...]
    predicted: float
    makespan: float

    @property
    def ok(self) -> bool:
        return all(o.state == "done" for o in self.jobs.values())

    def to_json(self) -> dict:
        """The report as JSON-able data (results as their ``summary`` when they have one)."""
        def result(r: Any) -> Any:
            return getattr(r, "summary", None) if hasattr(r, "summary") else (r if _jsonable(r) else repr(r))
        return {"predicted": self.predicted, "makespan": self.makespan,
                "replans": [{"at": r.at, "reason": r.reason, "moved": list(r.moved), "factors": dict(r.factors),
                             "plan": dataclasses.asdict(r.plan)} for r in self.replans],
                "jobs": {n: {"state": o.state, "error": o.error, "result": result(o.result),
                             "segments": [dataclasses.asdict(s) for s in o.segments]} for n, o in self.jobs.items()}}


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


@dataclass
class _Job:
    task: Task
    dir: Path
    state: str = "pending"  # pending, running, done, failed
    handle: Handle | None = None
    option: Option | None = None
    ids: tuple[int, ...] = ()
    started: float = 0.0
    expected_end: float = math.inf
    step_from: int = 0
    attempts: int = 0
    error: str | None = None
    result: Any = None
    segments: list = field(default_factory=list)
    pace: tuple[int, float, bool] | None = None  # (step, time, on the job's clock): where the pace window began


class Runner:
    """The event loop of a run (see the module doc); ``run()`` returns the :class:`RunReport`."""

    def __init__(self, tasks: Sequence[Task], options: Options, cluster: Devices, root: Path, *,
                 plan: Plan | None = None, backend: Any = None, retries: int = 0, replan: bool = True,
                 early: float = 0.1, drift_threshold: float | None = 0.2, solve_options: Mapping | None = None,
                 replan_time_limit: float = 2.0, stream: IO[str] | None = sys.stderr, refresh: float = 1.0,
                 poll: float = 0.2):
        tasks = check_unique_names(tasks)
        missing = sorted(t.name for t in tasks if not options.get(t.name))
        if missing:
            raise ValueError(f"jobs {missing} have no options to run with")
        check_runnable(tasks, {t.name: [o.technique for o in options[t.name]] for t in tasks})
        if retries < 0 or not 0 <= early < 1:
            raise ValueError(f"retries must be >= 0 and early in [0, 1), got {retries}, {early}")
        if drift_threshold is not None and not drift_threshold >= 0:
            raise ValueError(f"drift_threshold must be >= 0 (or None: no drift re-plans), got {drift_threshold}")
        self.options, self.cluster, self.root = options, cluster, Path(root)
        self.jobs = {t.name: _Job(t, self.root / t.name) for t in tasks}
        self.steps = {t.name: t.steps for t in tasks}
        self.backend = backend or LocalBackend()
        self.retries, self.replan_on, self.early, self.poll = retries, replan, early, poll
        self.drift_threshold = drift_threshold
        self.known: dict[str, float] = {}  # measured pace factors (1 when not measured)
        self.assumed: dict[str, float] = {}  # the factors the current plan was solved with
        self.solve_options = dict(solve_options or {})
        self.replan_options = {**self.solve_options, "time_limit": replan_time_limit}
        self.first = plan or solve({j: options[j] for j in self.jobs}, cluster.count, **self.solve_options)
        if set(self.first.by_job()) != set(self.jobs):
            raise ValueError("the plan does not hold exactly the jobs given")
        self.live = LiveTable(stream, refresh) if stream is not None else None
        self.replans: list[Replan] = []
        self.plan: Plan = self.first
        self.plan_at = 0.0
        self.t0 = 0.0

    # ------------------------------------------------------------------ the loop

    def run(self) -> RunReport:
        self.root.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.replans.append(Replan(0.0, "start", self.first))
        try:
            while any(j.state in ("pending", "running") for j in self.jobs.values()):
                changed = self._collect()
                changed |= self._watch_pace()
                changed |= self._start_ready()
                self._show(changed)
                time.sleep(self.poll)
        finally:
            for job in self.jobs.values():
                if job.handle is not None:
                    job.handle.stop()
            self.backend.close()
        ends = [s.end for j in self.jobs.values() for s in j.segments]
        starts = [s.start for j in self.jobs.values() for s in j.segments]
        report = RunReport({n: JobOutcome(n, j.state, j.error, j.result, tuple(j.segments)) for n, j in self.jobs.items()},
                           tuple(self.replans), self.first.makespan, max(ends, default=0.0) - min(starts, default=0.0))
        (self.root / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
        return report

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _collect(self) -> bool:
        """Take the results of attempts that ended; re-plan on a failure or an early finish."""
        reasons = []
        for name, job in self.jobs.items():
            if job.state != "running":
                continue
            msg = job.handle.poll()
            if msg is None:
                continue
            t = self.now()
            kind, value = msg
            ok, error = outcome_of(value) if kind == "ok" else (False, value)
            job.handle, job.result = None, value if kind == "ok" else None
            step = read_progress(job.dir).step
            job.segments.append(RunSegment(name, job.option.technique, job.ids, job.started, t, job.step_from,
                                           step, "done" if ok else "failed"))
            job.attempts += 1
            if ok:
                job.state = "done"
                early = job.expected_end - t
                if early > max(EARLY_SECONDS, self.early * job.option.seconds):
                    reasons.append(f"{name} finished {early:.1f} s early")
            else:
                job.error = error
                again = job.attempts <= self.retries
                job.state = "pending" if again else "failed"
                reasons.append(f"{name} failed" + (f" (retry {job.attempts} of {self.retries})" if again else "")
                               + f": {error.strip().splitlines()[0] if error.strip() else error}")
        if not reasons:
            return False
        if any(j.state in ("pending", "running") for j in self.jobs.values()):
            if self.replan_on:
                self._replan("; ".join(reasons))
            elif any(j.state == "pending" and j.error for j in self.jobs.values()):
                self._replan("; ".join(reasons))  # a retried job needs a place even without re-planning
        return True

    def _replan(self, reason: str) -> None:
        t = self.now()
        left, running = {}, {}
        for name, job in self.jobs.items():
            if job.state not in ("pending", "running"):
                continue
            done = checkpoint_step(job.dir)
            if job.state == "running" and done >= self.steps[name]:
                continue  # trained and checkpointed, finishing (its summary, plot): left where it is
            left[name] = max(1, self.steps[name] - done)  # a pending job with nothing to train still has to end
            if job.state == "running":
                step = max(read_progress(job.dir).step, job.step_from)
                running[name] = Running(job.option, job.ids, max(1, self.steps[name] - step))
        plan = replan(self.options, self.steps, left, self.cluster.count, factor=self.known, running=running,
                      solve_options=self.replan_options)
        self.assumed = dict(self.known)
        keep = stays(plan, running)
        moved = tuple(sorted(set(running) - keep))
        by_job = plan.by_job()
        for name in moved:
            self._stop(name, "moved")
        for name in keep:
            self.jobs[name].expected_end = t + by_job[name].option.seconds
        self.plan, self.plan_at = plan, t
        self.replans.append(Replan(t, reason, plan, moved, dict(self.known)))

    def _watch_pace(self) -> bool:
        """Measure every running job's seconds per step over its window (the module doc) and
        re-plan when one has drifted; returns whether it re-planned."""
        if self.drift_threshold is None or not self.replan_on:
            return False
        reasons, now = [], self.now()
        for name, job in self.jobs.items():
            if job.state != "running":
                continue
            p = read_progress(job.dir)
            if p.step <= job.step_from:
                continue  # nothing of this attempt logged yet (an older line, or none)
            own = math.isfinite(p.seconds)
            at = p.seconds if own else now
            if job.pace is None or job.pace[2] != own or p.step < job.pace[0]:
                job.pace = (p.step, at, own)  # from the end of a logged step: the first one's warm-up is not timed
                continue
            steps, seconds = p.step - job.pace[0], at - job.pace[1]
            if steps < DRIFT_STEPS or seconds < DRIFT_SECONDS:
                continue
            job.pace = (p.step, at, own)
            factor = seconds / steps / profiled_step(self.options, self.steps, name, job.option)
            assumed = self.assumed.get(name, 1.0)
            if drifted(factor, assumed, self.drift_threshold):
                self.known[name] = factor
                reasons.append(f"{name} steps take x{factor:.2f} the profile (the plan assumed x{assumed:.2f}; "
                               f"threshold {self.drift_threshold:g})")
        if not reasons:
            return False
        self._replan("; ".join(reasons))
        return True

    def _stop(self, name: str, how: str) -> None:
        job = self.jobs[name]
        job.handle.stop()
        job.handle = None
        job.segments.append(RunSegment(name, job.option.technique, job.ids, job.started, self.now(), job.step_from,
                                       read_progress(job.dir).step, how))
        job.state = "pending"

    def _start_ready(self) -> bool:
        """Start every pending job of the current plan whose device predecessors have ended."""
        started = False
        order = sorted(self.plan.assignments, key=lambda a: (a.start, a.job))
        held = {i for j in self.jobs.values() if j.state == "running" for i in j.ids}
        for k, a in enumerate(order):
            job = self.jobs[a.job]
            if job.state != "pending":
                continue
            before = [b for b in order[:k] if set(b.device_ids) & set(a.device_ids)]
            if any(self.jobs[b.job].state in ("pending", "running") for b in before) or held & set(a.device_ids):
                continue
            self._start(a)
            held |= set(a.device_ids)
            started = True
        return started

    def _start(self, a: Assignment) -> None:
        job = self.jobs[a.job]
        params = dict(a.option.params)
        devices = self.cluster.group(a.option.devices, physical_ids(self.cluster, a.device_ids))
        job.handle = self.backend.start(Attempt(job.task, a.option.technique, devices, params, self.steps[a.job],
                                                job.dir / "ckpt"))
        job.state, job.option, job.ids = "running", a.option, a.device_ids
        job.started = self.now()
        job.expected_end = job.started + a.option.seconds
        job.step_from = checkpoint_step(job.dir)
        job.pace = None

    # ------------------------------------------------------------------ the table

    def _show(self, changed: bool) -> None:
        """Show the table (the loop's last pass shows the final state: a job ending is a change)."""
        if self.live is None:
            return
        rows = []
        for name, job in self.jobs.items():
            p = read_progress(job.dir)
            a = self.plan.by_job().get(name)
            option = job.option if job.option is not None else (a.option if a else None)
            ids = job.ids if job.state == "running" or a is None else a.device_ids
            seconds = sum(s.end - s.start for s in job.segments) + (self.now() - job.started if job.state == "running"
                                                                      else 0.0)
            rows.append(Row(name, job.state, option.technique if option else "-", ",".join(map(str, ids)),
                            p.step, self.steps[name], p.loss, p.epsilon if job.task.private else None, seconds))
        self.live.show(format_table(rows, self.now()), changed=changed)


def run_jobs(tasks: Sequence[Task], options: Options, cluster: Devices, root: Path, **kwargs: Any) -> RunReport:
    """Execute the plan of ``tasks`` (``options`` per job for its full steps; ``plan`` solved
    from them unless given) on ``cluster`` with the ``Runner``; job ``j`` writes under
    ``root/j`` (``ckpt/``, and ``run/`` for the built-ins), the report to ``root/report.json``.

    Guarantees (``tests/test_jobs_run.py``): every job ends "done" or "failed" (with its
    error); jobs overlapping in time hold disjoint devices; a failure, an early finish or a
    pace drifting beyond ``drift_threshold`` (a fraction; None: never) re-plans the rest, a
    drift once per pace; a moved job resumes from its newest checkpoint. Raises ``ValueError``
    for a job without options, a plan of other jobs, or bad ``retries``/``early``/``drift_threshold``;
    ``DuplicateJobError`` for repeated names; a technique's refusal of a job it may run
    (``techniques.check_runnable``: the built-ins' ``UnimportableTaskError``) -- before anything starts."""
    return Runner(tasks, options, cluster, root, **kwargs).run()
