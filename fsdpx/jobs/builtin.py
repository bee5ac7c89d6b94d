"""The built-in techniques: this library's strategies (ddp, zero2, zero3, zero3 with ZenFlow
offload), each plain and private, executed through ``fsdpx train``'s run under torchrun: a GPT
job as ``fsdpx train``'s GPT, any other job as its own functions imported by the workers
(``train_run.py``), which is why a job whose functions cannot be imported by name is refused
(``check``) before anything runs.

Importing this module registers them (``fsdpx.jobs`` does on import). Tensor and pipeline
parallel plans join here as ``StrategyTechnique`` variants with their own memory model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import techniques
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


BUILTIN = {
    **{name: StrategyTechnique(name) for name in ("ddp", "zero2", "zero3")},
    "zero3+zenflow": StrategyTechnique("zero3", "zenflow"),
    **{f"{name}-private": StrategyTechnique(name, private=True) for name in ("ddp", "zero2", "zero3")},
    "zero3+zenflow-private": StrategyTechnique("zero3", "zenflow", private=True),
}


def register_builtins() -> None:
    """Register every technique of ``BUILTIN`` (again: replacing a user's technique of the same name)."""
    for name, technique in BUILTIN.items():
        techniques.register(name, technique, replace=True)


register_builtins()
