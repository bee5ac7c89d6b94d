"""Running one job on a device group: the impure edge (a torchrun process group per job).

``launch`` writes the job's ``RunConfig`` and starts ``torchrun -m fsdpx.jobs.worker`` on
``devices.count`` processes (GPUs chosen by ``CUDA_VISIBLE_DEVICES``, CPU cores by affinity;
the directories a user job's functions were imported from on ``PYTHONPATH``);
``JobResult`` is what came back. torchrun dies with the process that launched it and its
workers with torchrun or that process (``fsdpx.train.launch.die_with_parent`` /
``watch_launcher``), so stopping a job (``runner.py``) or killing the runner leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpx.train import RunConfig
from fsdpx.train.launch import LAUNCHER_PID, die_with_parent, torchrun_command

from .devices import Devices


@dataclass(frozen=True)
class JobResult:
    """How a job's process group ended: ``returncode`` 0 and its ``summary`` (``fsdpx.train.run``'s,
    non-finite numbers as None), or the ``error`` (the output's tail); ``peak_bytes`` per rank;
    ``seconds`` of wall time including process start."""

    name: str
    returncode: int
    run_dir: str
    seconds: float
    summary: dict[str, Any] | None = None
    peak_bytes: tuple[int, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def launch(name: str, config: RunConfig, devices: Devices) -> JobResult:
    """Run ``config`` on ``devices.count`` local processes and wait; returns its
    :class:`JobResult` (a failed run is a result with its error, never an exception)."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run_config.json"
    path.write_text(json.dumps(dataclasses.asdict(config), indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", LAUNCHER_PID: str(os.getpid())}
    roots = import_roots(config)
    if roots:
        env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [os.environ.get("PYTHONPATH")])])
    cores: set[int] = set()
    if devices.ids is not None and devices.kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices.ids))
    elif devices.ids is not None and hasattr(os, "sched_setaffinity"):
        cores = set(devices.ids) & os.sched_getaffinity(0)

    def preexec() -> None:
        die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)
    cmd = torchrun_command(devices.count, ["fsdpx.jobs.worker", str(path)], module=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          preexec_fn=preexec)
    seconds = time.perf_counter() - start
    summary_file = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_file.exists():
        return JobResult(name, proc.returncode or 1, str(run_dir), seconds, error=proc.stdout[-4000:])
    peaks = tuple(json.loads((run_dir / f"rank{r}.json").read_text())["peak_bytes"] for r in range(devices.count))
    return JobResult(name, 0, str(run_dir), seconds, json.loads(summary_file.read_text()), peaks)


def import_roots(config: RunConfig) -> list[str]:
    """The ``sys.path`` directories this process imported a ``model = "python"`` run's functions
    from (``fsdpx.train.refs.import_root``), for the workers' ``PYTHONPATH``: a module found
    here (a test module beside its tests, a script's directory) is found there too."""
    if config.model.kind != "python":
        return []
    from fsdpx.train.refs import import_root

    refs = (config.model.model_fn, config.data.data_fn, config.model.loss_fn)
    roots = (import_root(ref.partition(":")[0]) for ref in refs)
    return sorted({r for r in roots if r is not None})


def step_seconds(run_dir: str | Path) -> list[float]:
    """Wall seconds of each step recorded in ``metrics.jsonl``: its ``step_seconds`` column
    (``fsdpx.train.loop``'s module doc; the first step's is measured from the loop start). A user
    technique's run directory holds the same column for its steps to be profiled."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [r["step_seconds"] for r in rows]
