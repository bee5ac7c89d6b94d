"""A job to train, as data: what to build (lazily, inside the worker) and how long to train it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping


class DuplicateJobError(ValueError):
    """Two jobs of one plan share a name (names key profiles, run directories and checkpoints)."""


class UnsupportedTaskError(ValueError):
    """A technique cannot run this job at all, on any devices (a technique's ``check``)."""


class UnimportableTaskError(UnsupportedTaskError):
    """A job's function cannot be imported by the processes that train it (a lambda, a function
    defined inside another, one of the script run as ``__main__``), or its ``hparams`` are not
    JSON values: the built-in techniques run a job in torchrun workers, which import its
    functions by name."""


@dataclass(frozen=True)
class Privacy:
    """DP-SGD settings of a private job: noise from ``noise_multiplier`` when given, otherwise
    calibrated so that ``steps`` steps spend ``target_epsilon`` at ``delta``."""

    target_epsilon: float | None = 8.0
    delta: float = 1e-5
    clip_norm: float = 1.0
    noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("Privacy needs target_epsilon or noise_multiplier")


@dataclass(frozen=True, eq=False)
class Task:
    """One training job.

    ``model_fn(hparams) -> nn.Module``, ``data_fn(hparams) -> (inputs, targets)`` (the whole
    dataset; batches are Poisson draws of expected size ``batch_size``) and
    ``loss_fn(outputs, targets) -> per-example losses (B,)`` are called inside the process that
    trains the job, never by the planner (which only builds the model on the meta device to
    read its shapes). The built-in techniques train in torchrun workers that import the three
    functions by name: define them with ``def`` at the top level of an importable module, and
    keep ``hparams`` JSON values (else ``UnimportableTaskError`` before anything runs).
    ``privacy=None`` trains without DP-SGD. ``hparams`` is passed to the
    functions and is part of the job's identity (the profile cache key). Tasks compare and
    hash by identity: two jobs are two objects even with equal fields.

    Raises ``ValueError`` for an empty name, ``steps < 1`` or ``batch_size <= 0``.
    """

    name: str
    model_fn: Callable[[Mapping[str, Any]], Any]
    data_fn: Callable[[Mapping[str, Any]], Any]
    loss_fn: Callable[[Any, Any], Any]
    steps: int
    batch_size: float
    privacy: Privacy | None = None
    hparams: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, name: str, model_fn: Callable, data_fn: Callable, loss_fn: Callable, *, steps: int,
                 batch_size: float, privacy: Privacy | None = None, hparams: Mapping[str, Any] | None = None):
        if not name or "/" in name:
            raise ValueError(f"a job needs a non-empty name without '/', got {name!r}")
        if steps < 1:
            raise ValueError(f"job {name!r}: steps must be >= 1, got {steps}")
        if not batch_size > 0:
            raise ValueError(f"job {name!r}: batch_size must be > 0, got {batch_size}")
        for k, v in (("name", name), ("model_fn", model_fn), ("data_fn", data_fn), ("loss_fn", loss_fn),
                     ("steps", steps), ("batch_size", batch_size), ("privacy", privacy),
                     ("hparams", dict(hparams or {}))):
            object.__setattr__(self, k, v)

    @property
    def private(self) -> bool:
        return self.privacy is not None


def check_unique_names(tasks: Iterable[Task]) -> list[Task]:
    """``tasks`` as a list; raises :class:`DuplicateJobError` naming every repeated name
    (``tests/test_jobs_registry.py::test_duplicate_job_names_are_a_named_error``)."""
    tasks = list(tasks)
    seen: set[str] = set()
    repeated = sorted({t.name for t in tasks if t.name in seen or seen.add(t.name)})
    if repeated:
        raise DuplicateJobError(f"job names must be unique; repeated: {repeated}")
    return tasks
