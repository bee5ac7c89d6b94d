"""The technique registry: a parallelism the planner may choose for a job.

A technique is any object with three methods (the :class:`Technique` protocol)::

    feasible(task, devices) -> bool            # from the memory model; no process started
    search(task, devices) -> dict              # its own knobs on these devices (JSON-able)
    execute(task, devices, params, steps, ckpt_dir) -> JobResult   # train to ``steps``

and optionally ``check(task)``, raising an ``UnsupportedTaskError`` (a named error saying how
to fix it) when it cannot run the job on any devices: ``check_feasible`` raises it for a job
no technique takes, and the runner (``check_runnable``) before anything starts.

``register(name, technique)`` adds one; the planner considers every registered technique for
every job. Built-ins are registered by ``fsdpx.jobs.builtin`` on import, which ``fsdpx.jobs``
defers to the registry's first use (:func:`register_later`): the built-ins load torch, and
``fsdpx jobs --help`` needs none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from .devices import Devices
from .task import Task, UnsupportedTaskError


class InfeasibleJobError(ValueError):
    """A job fits no registered technique at any allowed device count of the cluster."""


class UnknownTechniqueError(KeyError):
    """A plan or profile names a technique that is not registered."""


@runtime_checkable
class Technique(Protocol):
    def feasible(self, task: Task, devices: Devices) -> bool: ...

    def search(self, task: Task, devices: Devices) -> Mapping[str, Any]: ...

    def execute(self, task: Task, devices: Devices, params: Mapping[str, Any], steps: int,
                ckpt_dir: Path) -> Any: ...


_REGISTRY: dict[str, Technique] = {}
_PENDING: list[Callable[[], Any]] = []  # loaders that register techniques, run at the registry's first use


def register_later(load: Callable[[], Any]) -> None:
    """Call ``load`` (which registers techniques, e.g. by importing their module) just before
    the registry is next read or written, once. ``fsdpx.jobs`` registers its built-ins this way:
    importing the package stays light, and every function here sees them, a user's ``register``
    of a taken name included (``tests/test_fast_feedback.py::test_the_built_in_techniques_load_on_first_use``)."""
    _PENDING.append(load)


def _registry() -> dict[str, Technique]:
    """The registry, after the pending loaders (each popped before it runs: it registers)."""
    while _PENDING:
        _PENDING.pop(0)()
    return _REGISTRY


def register(name: str, technique: Technique, *, replace: bool = False) -> Technique:
    """Add ``technique`` under ``name``; returns it. Raises ``TypeError`` if it lacks one of
    the three methods and ``ValueError`` if ``name`` is taken (unless ``replace``)
    (``tests/test_jobs_registry.py::test_a_user_registers_a_toy_technique``)."""
    if not isinstance(technique, Technique):
        raise TypeError(f"technique {name!r} must have feasible, search and execute methods")
    if name in _registry() and not replace:
        raise ValueError(f"technique {name!r} is already registered; pass replace=True to swap it")
    _registry()[name] = technique
    return technique


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (``UnknownTechniqueError`` if absent)."""
    if name not in _registry():
        raise UnknownTechniqueError(name)
    del _registry()[name]


def get(name: str) -> Technique:
    """The technique registered as ``name`` (``UnknownTechniqueError`` listing the known ones)."""
    try:
        return _registry()[name]
    except KeyError:
        raise UnknownTechniqueError(f"no technique {name!r}; registered: {sorted(_registry())}") from None


def names() -> list[str]:
    """Registered technique names, sorted."""
    return sorted(_registry())


def device_counts(cluster: Devices) -> list[int]:
    """The group sizes the planner tries on ``cluster``: powers of two up to its size, and the
    size itself."""
    out, n = [], 1
    while n <= cluster.count:
        out.append(n)
        n *= 2
    return sorted({*out, cluster.count})


def refusal(technique: Any, task: Task) -> UnsupportedTaskError | None:
    """The error ``technique.check(task)`` raises (None when it has no ``check`` or runs the job)."""
    check = getattr(technique, "check", None)
    try:
        if check is not None:
            check(task)
    except UnsupportedTaskError as e:
        return e
    return None


def check_runnable(tasks: Iterable[Task], chosen: Mapping[str, Iterable[str]]) -> None:
    """Raise the first refusal (:func:`refusal`) of a job by a registered technique among
    ``chosen[job name]`` (the techniques a plan may run it with); unregistered names are
    skipped."""
    for task in tasks:
        for name in sorted(set(chosen.get(task.name, ()))):
            if name in _registry() and (err := refusal(_registry()[name], task)) is not None:
                raise err


def feasible_choices(task: Task, cluster: Devices, techniques: Iterable[str] | None = None) -> list[tuple[str, int]]:
    """Every (technique, device count) on which ``task`` fits, techniques in name order, counts
    ascending; empty when none fits."""
    chosen = names() if techniques is None else list(techniques)
    return [(t, n) for t in chosen for n in device_counts(cluster) if get(t).feasible(task, cluster.group(n))]


def check_feasible(tasks: Iterable[Task], cluster: Devices, techniques: Iterable[str] | None = None
                   ) -> dict[str, list[tuple[str, int]]]:
    """``{job name: feasible_choices}`` for every job; raises :class:`InfeasibleJobError`
    naming every job that fits nowhere, before anything runs
    (``tests/test_jobs_registry.py::test_a_job_too_large_for_the_cluster_is_a_named_error``),
    or, when a technique refused such a job by its ``check``, that refusal (e.g. the built-ins'
    ``UnimportableTaskError`` for a lambda: ``tests/test_jobs_user_task.py``)."""
    tasks = list(tasks)
    techniques = None if techniques is None else list(techniques)
    out = {t.name: feasible_choices(t, cluster, techniques) for t in tasks}
    bad = sorted(name for name, choices in out.items() if not choices)
    for task in tasks:
        if task.name in bad:
            check_runnable([task], {task.name: techniques or names()})
    if bad:
        raise InfeasibleJobError(
            f"jobs {bad} fit no technique on any group of up to {cluster.count} devices of "
            f"{cluster.memory_bytes / 2**30:.2f} GiB (techniques tried: {techniques or names()})")
    return out
