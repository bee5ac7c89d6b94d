"""The built-in techniques: this library's strategies (ddp, zero2, zero3, zero3 with ZenFlow
offload), each plain and private, executed through ``fsdpx train``'s run under torchrun: a GPT
job as ``fsdpx train``'s GPT, any other job as its own functions imported by the workers
(``train_run.py``), which is why a job whose functions cannot be imported by name is refused
(``check``) before anything runs.

Tensor, pipeline and 3-D parallelism (``tp``, ``pp``, ``3d``, each plain and private) are
``ParallelTechnique``s: their ``search`` picks the degrees, schedule and microbatches that fit
the devices and the memory model (``parallel.py``). Importing this module registers them all
(``fsdpx.jobs`` does on import).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from . import parallel, techniques
from fsdpx.train.layout import Layout

from .devices import Devices
from .execute import JobResult, launch
from .memory import job_memory
from .task import Task
from .train_run import check_runnable, run_config

ZENFLOW_TOPK = (0.5, 0.25, 0.1, 0.05)
"""Fractions of columns ZenFlow may keep on the device, most preferred first (more columns
updated every step, less host traffic)."""


@dataclass(frozen=True)
class StrategyTechnique:
    """A data-parallel ``strategy`` of ``fsdpx.sharding.strategies`` (with ``offload`` "none" or
    "zenflow"), for plain jobs or, with ``private``, for private ones only."""

    strategy: str
    offload: str = "none"
    private: bool = False

    def _fraction(self, params: Mapping[str, Any]) -> float:
        return params.get("offload_topk", 1.0) if self.offload == "zenflow" else 1.0

    def memory(self, task: Task, devices: Devices, params: Mapping[str, Any]) -> int:
        """The memory model's peak bytes per rank with ``params``."""
        return job_memory(task, self.strategy, devices.count, optimizer_fraction=self._fraction(params))

    def check(self, task: Task) -> None:
        """Raise ``UnimportableTaskError`` when the workers could not import the job's functions
        (``train_run.check_runnable``); nothing for a GPT job."""
        check_runnable(task)

    def search(self, task: Task, devices: Devices) -> dict[str, Any]:
        """``{}``; with ZenFlow the largest ``offload_topk`` of ``ZENFLOW_TOPK`` that fits (the
        smallest when none does). Raises what ``check`` raises."""
        self.check(task)
        if self.offload != "zenflow":
            return {}
        for topk in ZENFLOW_TOPK:
            if job_memory(task, self.strategy, devices.count, optimizer_fraction=topk) <= devices.memory_bytes:
                return {"offload_topk": topk}
        return {"offload_topk": ZENFLOW_TOPK[-1]}

    def feasible(self, task: Task, devices: Devices) -> bool:
        """Whether the job's privacy matches this technique's, its functions can be imported by the
        workers (``check``) and, with ``search``'s params, the memory model fits
        ``devices.memory_bytes`` per rank."""
        if task.private != self.private or techniques.refusal(self, task) is not None:
            return False
        return self.memory(task, devices, self.search(task, devices)) <= devices.memory_bytes

    def execute(self, task: Task, devices: Devices, params: Mapping[str, Any], steps: int, ckpt_dir: Path
                ) -> JobResult:
        """Train ``task`` up to step ``steps`` on ``devices`` (resuming from ``ckpt_dir``), its run
        directory beside ``ckpt_dir``."""
        ckpt_dir = Path(ckpt_dir)
        config = run_config(task, strategy=self.strategy, steps=steps, out=ckpt_dir.parent, ckpt_dir=ckpt_dir,
                            offload=self.offload, offload_topk=self._fraction(params) if self.offload != "none"
                            else 0.1)
        return launch(task.name, config, devices)


DATA_STRATEGIES = ("zero2", "zero3")
"""The data-parallel strategies a parallel technique may put over its ``dp`` ranks, preferred
first: ZeRO-2 moves what DDP moves with a sharded optimizer; ZeRO-3 also gathers the
parameters (more traffic), only when ZeRO-2 does not fit."""

FAMILIES = ("tp", "pp", "3d")


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def pipeline_choices(task: Task, pp: int, dp: int) -> list[dict[str, Any]]:
    """Schedules for ``pp`` stages, fastest first by ``parallel.step_units`` (the simulated
    bubble; a private task's as a private pipeline runs), ties to fewer microbatches: 1f1b, zero_bubble and interleaved 1f1b (2 stages per
    rank), each on ``pp`` or ``2 pp`` microbatches (those no larger than the expected batch
    share of a data-parallel rank, at least ``pp``: more microbatches shrink the bubble, but
    each pays its own collectives and Python, which the unit-cost simulation does not price)."""
    share = max(1, math.floor(task.batch_size / dp))
    counts = [m for m in (pp, 2 * pp) if m <= share] or [pp]
    out = [dict(schedule=k, microbatches=m, virtual_stages=v) for m in counts
           for k, v in (("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2))]
    return sorted(out, key=lambda c: (parallel.step_units(Layout(DATA_STRATEGIES[0], pp=pp, **c), private=task.private),
                                      c["microbatches"]))


def candidates(task: Task, family: str, n: int) -> list[Layout]:
    """Every layout of ``family`` on ``n`` ranks, in the order ``ParallelTechnique.search``
    prefers them: the fewest model-parallel ranks first (``tp``: the degree; ``pp``: the stages;
    ``3d``: ``tp x pp``, then the smaller ``tp``), each with ``DATA_STRATEGIES`` in order and a
    pipeline's ``pipeline_choices``. Degrees the model may not take are listed too (``search``
    skips them)."""
    if family == "tp":
        pairs = [(t, 1) for t in _divisors(n)]
    elif family == "pp":
        pairs = [(1, q) for q in _divisors(n)]
    else:
        pairs = sorted(((t, q) for t in _divisors(n) for q in _divisors(n // t)), key=lambda tq: (tq[0] * tq[1], tq[0]))
    out = []
    for t, q in pairs:
        for strategy in DATA_STRATEGIES:
            pipes = pipeline_choices(task, q, n // (t * q)) if q > 1 else [{}]
            out += [Layout(strategy, tp=t, pp=q, **c) for c in pipes]
    return out


@dataclass(frozen=True)
class ParallelTechnique:
    """Tensor (``tp``), pipeline (``pp``) or both (``3d``) parallelism with data parallelism
    over the ranks left, for plain jobs or, with ``private``, private ones: ``fsdpx train --tp
    --pp --schedule --microbatches``. ``search`` picks the degrees (``candidates``' first whose
    plan resolves on the job's model and fits the memory model, ``parallel.memory``)."""

    family: str
    private: bool = False

    def check(self, task: Task) -> None:
        """As the other built-ins: ``train_run.check_runnable``."""
        check_runnable(task)

    def choose(self, task: Task, devices: Devices) -> Layout | None:
        """The first of ``candidates`` that fits (None when none does)."""
        return _choose(task, self.family, devices.count, devices.memory_bytes)

    def search(self, task: Task, devices: Devices) -> dict[str, Any]:
        """The chosen ``Layout`` as params (``strategy``, ``tp``, ``pp``, ``schedule``,
        ``microbatches``, ``virtual_stages``); ``{}`` when nothing fits (``feasible`` is False)."""
        self.check(task)
        chosen = self.choose(task, devices)
        return chosen.params() if chosen is not None else {}

    def feasible(self, task: Task, devices: Devices) -> bool:
        """Whether the job's privacy is this technique's, the workers can import it, and some
        layout of the family resolves on its model and fits ``devices.memory_bytes`` per rank."""
        if task.private != self.private or techniques.refusal(self, task) is not None:
            return False
        return self.choose(task, devices) is not None

    def memory(self, task: Task, devices: Devices, params: Mapping[str, Any]) -> int:
        """The memory model's peak bytes per rank with ``params`` (``search``'s when empty)."""
        degrees = Layout.of(params) if params else self.choose(task, devices)
        got = parallel.memory(task, devices.count, degrees) if degrees is not None else None
        return got if got is not None else 2**63 - 1

    def sent_bytes(self, task: Task, devices: Devices) -> int:
        """Bytes rank 0 sends per step with ``search``'s degrees (``parallel.sent_bytes``), for
        the profile's step model."""
        degrees = self.choose(task, devices)
        return (parallel.sent_bytes(task, devices.count, degrees) or 0) if degrees is not None else 0

    def execute(self, task: Task, devices: Devices, params: Mapping[str, Any], steps: int, ckpt_dir: Path
                ) -> JobResult:
        """Train ``task`` up to step ``steps`` on ``devices`` with the degrees of ``params``."""
        d = Layout.of(params)
        ckpt_dir = Path(ckpt_dir)
        config = run_config(task, steps=steps, out=ckpt_dir.parent, ckpt_dir=ckpt_dir, **d.params())
        return launch(task.name, config, devices)


@lru_cache(maxsize=512)
def _choose(task: Task, family: str, n: int, memory_bytes: int) -> Layout | None:
    for degrees in candidates(task, family, n):
        got = parallel.memory(task, n, degrees)
        if got is not None and got <= memory_bytes:
            return degrees
    return None


BUILTIN = {
    **{name: StrategyTechnique(name) for name in ("ddp", "zero2", "zero3")},
    "zero3+zenflow": StrategyTechnique("zero3", "zenflow"),
    **{name: ParallelTechnique(name) for name in FAMILIES},
    **{f"{name}-private": StrategyTechnique(name, private=True) for name in ("ddp", "zero2", "zero3")},
    "zero3+zenflow-private": StrategyTechnique("zero3", "zenflow", private=True),
    **{f"{name}-private": ParallelTechnique(name, private=True) for name in FAMILIES},
}


def register_builtins() -> None:
    """Register every technique of ``BUILTIN`` (again: replacing a user's technique of the same name)."""
    for name, technique in BUILTIN.items():
        techniques.register(name, technique, replace=True)


register_builtins()
