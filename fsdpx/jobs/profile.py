"""Profiles: (job, technique, device count) -> (step seconds, peak bytes per rank), measured
or predicted (pure).

A prediction for an unprofiled count fits ``t(n) = compute / n + per_byte * sent(n) + fixed``
(non-negative least squares) to the job's measured points under one technique, where
``sent(n)`` is the bytes a rank sends per step by the cost model (``comm_per_step``); the
peak memory is the memory model's (``job_memory``) plus what the measured peak exceeded it by
(the process's own baseline), taken from the nearest measured count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

from fsdpx.sharding import strategies
from fsdpx.sharding.cost_model import comm_per_step
from fsdpx.sharding.mesh import Mesh

from .memory import model_shape
from .plan import Option, Options
from .task import Task

Key = tuple[str, str, int]
"""``(job name, technique, device count)``."""


@dataclass(frozen=True)
class Measurement:
    """Seconds per step and peak bytes on the worst rank; ``measured`` False for a prediction;
    ``startup_seconds``: a run's wall time beyond its steps (process start, model build, the
    end's sample and plot), paid once per start."""

    step_seconds: float
    peak_bytes: int
    measured: bool = True
    params: tuple[tuple[str, object], ...] = ()
    startup_seconds: float = 0.0


def sent_bytes(task: Task, strategy: str, n: int) -> int:
    """Bytes a rank sends per step under ``strategy`` on ``n`` ranks (``comm_per_step``)."""
    shape = model_shape(task)
    cost = comm_per_step(strategies.ALL[strategy](axis="dp"), shape.param_shapes, Mesh(dp=n),
                         [list(u) for u in shape.units])
    return int(cost["send_bytes"])


@dataclass(frozen=True)
class StepModel:
    """``seconds(n, sent) = compute / n + per_byte * sent + fixed``, all coefficients >= 0."""

    compute: float
    per_byte: float
    fixed: float

    def seconds(self, n: int, sent: int) -> float:
        return self.compute / n + self.per_byte * sent + self.fixed


def fit_step_model(points: Sequence[tuple[int, int, float]]) -> StepModel:
    """The non-negative least-squares :class:`StepModel` of ``(n, sent bytes, seconds)`` points.
    One point: all time is compute (``compute = n * seconds``). Raises ``ValueError`` on none.

    Guarantee: recovers the coefficients exactly from three or more exact points with distinct
    ``n`` and independent columns (``tests/test_jobs_profile.py::test_the_step_model_recovers_its_coefficients``)."""
    if not points:
        raise ValueError("fit_step_model needs at least one measured point")
    if len({n for n, _, _ in points}) == 1:
        n, _, t = points[0]
        return StepModel(n * t, 0.0, 0.0)
    A = np.array([[1.0 / n, float(s), 1.0] for n, s, _ in points])
    b = np.array([t for _, _, t in points])
    scale = np.maximum(np.abs(A).max(axis=0), 1e-30)  # columns of very different magnitude
    coef, _ = nnls(A / scale, b)
    coef = coef / scale
    return StepModel(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclass(frozen=True)
class CrossCheck:
    """The step time at ``devices`` predicted from the profiles at the ``others`` counts only,
    and the one measured there: how far the step model's predictions for unprofiled counts can
    be trusted (``error``: ``|predicted / measured - 1|``; from a single other count the model
    can only assume the whole step is compute, ``seconds x n / devices``)."""

    devices: int
    others: tuple[int, ...]
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return abs(self.predicted / self.measured - 1)


@dataclass
class ProfileTable:
    """Measurements by ``(job, technique, count)``; ``predict`` fills the other counts."""

    entries: dict[Key, Measurement] = field(default_factory=dict)

    def add(self, job: str, technique: str, devices: int, m: Measurement) -> None:
        self.entries[(job, technique, devices)] = m

    def measured(self, job: str, technique: str) -> dict[int, Measurement]:
        return {n: m for (j, t, n), m in self.entries.items() if j == job and t == technique and m.measured}

    def predict(self, task: Task, technique: str, strategy: str | Callable[[int], int], counts: Iterable[int],
                memory_of=None, params_of: Callable[[int], Mapping[str, object]] | None = None
                ) -> dict[int, Measurement]:
        """Predictions for ``counts`` of ``task`` under ``technique`` (whose sharding is
        ``strategy``, or whose bytes sent per step on ``n`` devices are ``strategy(n)``), from the
        measured points (measured counts keep their measurement); ``memory_of(n)`` is the memory
        model's estimate (default: no memory prediction, 0); ``params_of(n)`` the technique's
        params on ``n`` devices (default: the nearest measured count's). Adds them to the table
        and returns them. Raises ``ValueError`` with no measured point."""
        sent = strategy if callable(strategy) else (lambda n: sent_bytes(task, strategy, n))
        got = self.measured(task.name, technique)
        model = fit_step_model([(n, sent(n), m.step_seconds) for n, m in sorted(got.items())])
        out = {}
        for n in counts:
            if n in got:
                out[n] = got[n]
                continue
            near = min(got, key=lambda k: (abs(k - n), k))
            extra = got[near].peak_bytes - (memory_of(near) if memory_of else 0)
            peak = (memory_of(n) if memory_of else 0) + max(0, extra)
            params = tuple(sorted(params_of(n).items())) if params_of else got[near].params
            out[n] = Measurement(model.seconds(n, sent(n)), peak, False, params, got[near].startup_seconds)
            self.add(task.name, technique, n, out[n])
        return out

    def fit_errors(self, task: Task, technique: str, strategy: str | Callable[[int], int]) -> dict[int, float]:
        """The prediction error at every measured count of ``task`` under ``technique``:
        ``|predicted / measured - 1|`` where the prediction is fitted to the OTHER measured
        counts (leave one out; the step model fits 3 coefficients, so an in-sample error on
        two or three points would be 0 and say nothing). Empty with fewer than two points."""
        return {n: c.error for n, c in self.cross_checks(task, technique, strategy).items()}

    def cross_checks(self, task: Task, technique: str, strategy: str | Callable[[int], int]) -> dict[int, "CrossCheck"]:
        """For every measured count of ``task`` under ``technique``, its step time predicted from
        the OTHER measured counts beside the measured one (:class:`CrossCheck`; what
        :meth:`fit_errors` reports). Empty with fewer than two points."""
        sent = strategy if callable(strategy) else (lambda n: sent_bytes(task, strategy, n))
        got = self.measured(task.name, technique)
        points = {n: (n, sent(n), m.step_seconds) for n, m in got.items()}
        out = {}
        for n in sorted(points) if len(points) > 1 else []:
            others = tuple(k for k in sorted(points) if k != n)
            model = fit_step_model([points[k] for k in others])
            out[n] = CrossCheck(n, others, model.seconds(n, points[n][1]), points[n][2])
        return out

    def options(self, tasks: Iterable[Task], steps_left: Mapping[str, int] | None = None,
                feasible: Mapping[str, Iterable[tuple[str, int]]] | None = None) -> Options:
        """The solver's input: per job an :class:`Option` for every table entry (restricted to
        ``feasible`` pairs when given), lasting ``steps_left[job]`` (default ``task.steps``) steps
        plus the measurement's startup (``Option.startup``)."""
        out: dict[str, list[Option]] = {}
        for task in tasks:
            steps = (steps_left or {}).get(task.name, task.steps)
            allowed = None if feasible is None else set(feasible[task.name])
            out[task.name] = [Option(t, n, m.startup_seconds + steps * m.step_seconds, m.params, m.startup_seconds)
                              for (j, t, n), m in sorted(self.entries.items())
                              if j == task.name and (allowed is None or (t, n) in allowed)]
        return out
