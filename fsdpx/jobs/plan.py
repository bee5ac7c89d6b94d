"""Plans are data: what the solver chose for every job, kept apart from running it.

An :class:`Option` is one way to run a job (technique, device count, seconds for its
remaining steps); a :class:`Plan` gives every job one option, a start time and the device ids
it holds from ``start`` to ``end``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


class PlanError(ValueError):
    """A planning problem that cannot be solved as given (no options for a job, bad sizes)."""


@dataclass(frozen=True, order=True)
class Option:
    """Run a job with ``technique`` on ``devices`` devices for ``seconds`` (its remaining steps);
    ``params`` are the technique's knobs (``Technique.search``), as sorted ``(key, value)`` pairs.
    ``startup`` is the part of ``seconds`` spent before the first step (starting processes,
    building the model, restoring a checkpoint): paid again by every restart, so a job moved by
    checkpoint-and-restart pays it twice (``replan.remaining_options``)."""

    technique: str
    devices: int
    seconds: float
    params: tuple[tuple[str, Any], ...] = ()
    startup: float = 0.0

    def __post_init__(self) -> None:
        if self.devices < 1 or not self.seconds > 0:
            raise PlanError(f"an option needs devices >= 1 and seconds > 0, got {self.devices}, {self.seconds}")
        if not 0 <= self.startup <= self.seconds:
            raise PlanError(f"an option's startup must be in [0, seconds={self.seconds}], got {self.startup}")


Options = Mapping[str, Sequence[Option]]
"""Every job's options: ``{job name: [Option, ...]}``."""


@dataclass(frozen=True)
class Assignment:
    """Job ``job`` runs ``option`` on device ids ``device_ids`` over ``[start, end)`` seconds."""

    job: str
    option: Option
    start: float
    device_ids: tuple[int, ...]

    @property
    def end(self) -> float:
        return self.start + self.option.seconds


@dataclass(frozen=True)
class Plan:
    """One assignment per job (sorted by start, then name) on ``cluster_size`` devices.

    ``lower_bound`` is a proven bound on the objective of any schedule of the same options
    (``bounds.py``); ``method`` says which schedule won (``"milp"`` or ``"greedy"``);
    ``greedy_makespan`` is the greedy list schedule's, which the plan never exceeds."""

    assignments: tuple[Assignment, ...]
    cluster_size: int
    lower_bound: float
    method: str
    greedy_makespan: float
    solve_seconds: float = 0.0
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def makespan(self) -> float:
        return max((a.end for a in self.assignments), default=0.0)

    @property
    def gap(self) -> float:
        """``makespan / lower_bound - 1`` (0 when the bound is 0)."""
        return self.makespan / self.lower_bound - 1 if self.lower_bound > 0 else 0.0

    def weighted_completion(self, weights: Mapping[str, float] | None = None) -> float:
        return sum((weights or {}).get(a.job, 1.0) * a.end for a in self.assignments)

    def by_job(self) -> dict[str, Assignment]:
        return {a.job: a for a in self.assignments}


def check_options(options: Options, cluster_size: int) -> None:
    """Raise :class:`PlanError` if a job has no option or an option needs more than
    ``cluster_size`` devices."""
    if cluster_size < 1:
        raise PlanError(f"cluster_size must be >= 1, got {cluster_size}")
    for job, opts in options.items():
        if not opts:
            raise PlanError(f"job {job!r} has no option")
        too_big = [o for o in opts if o.devices > cluster_size]
        if too_big:
            raise PlanError(f"job {job!r} has options on more than {cluster_size} devices: {too_big}")


def useful_options(opts: Sequence[Option]) -> list[Option]:
    """The options worth considering, by ascending device count: per count the fastest (ties:
    technique name), then only counts strictly faster than every smaller count (a wider group
    that is not faster is dominated: more devices, no less time).

    Guarantee: for every dropped option there is a kept one with no more devices and no more
    seconds (``property_tests/test_jobs_properties.py::test_pruning_keeps_a_dominating_option``)."""
    best: dict[int, Option] = {}
    for o in sorted(opts, key=lambda o: (o.devices, o.seconds, o.technique, o.params)):
        best.setdefault(o.devices, o)
    out: list[Option] = []
    for n in sorted(best):
        if not out or best[n].seconds < out[-1].seconds:
            out.append(best[n])
    return out
