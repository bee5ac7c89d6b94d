"""Profiling runs and their on-disk cache (the impure edge of profiles).

A measurement is cached in ``<root>/<key>.json``, the key a hash of the job's identity (its
functions' qualified names, parameter shapes, hparams, batch size and privacy), the
technique, its params, the device count and the hardware fingerprint: a profile is reused
only for the same job on the same hardware.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Mapping

from . import techniques
from .devices import Devices, hardware_fingerprint
from .memory import model_shape
from .profile import Measurement
from .task import Task


CACHE_VERSION = 2
"""Bumped when a cached measurement gains a field (2: ``startup_seconds``): older entries are not reused."""


def job_hash(task: Task) -> str:
    """A hash of what a job's step time depends on (not its name or step count)."""
    fn = lambda f: f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"  # noqa: E731
    text = json.dumps({"fns": [fn(task.model_fn), fn(task.data_fn), fn(task.loss_fn)],
                       "shapes": sorted(model_shape(task).param_shapes.items()), "hparams": sorted(task.hparams.items()),
                       "batch": task.batch_size, "privacy": repr(task.privacy)}, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(task: Task, technique: str, params: Mapping[str, Any], devices: Devices) -> str:
    text = json.dumps([CACHE_VERSION, job_hash(task), technique, sorted(params.items()), devices.count,
                       hardware_fingerprint(devices)], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def profile(task: Task, technique: str, devices: Devices, *, root: Path, steps: int = 4) -> Measurement:
    """The cached measurement of ``task`` under ``technique`` on ``devices``, or a new one: the
    technique's ``execute`` runs ``min(steps, task.steps)`` real steps in a scratch directory;
    step time is the median of the steps after the first (the first one warms up), peak
    bytes the worst rank's, startup the run's wall time beyond ``steps x`` that median (so
    ``startup + steps x step`` is the profiled run's wall time). Raises ``RuntimeError`` with
    the run's error when it fails."""
    tech = techniques.get(technique)
    params = dict(tech.search(task, devices))
    path = Path(root) / f"{cache_key(task, technique, params, devices)}.json"
    if path.exists():
        d = json.loads(path.read_text())
        return Measurement(d["step_seconds"], d["peak_bytes"], True, tuple(sorted(params.items())),
                           d["startup_seconds"])
    from .execute import step_seconds

    with tempfile.TemporaryDirectory() as scratch:
        result = tech.execute(task, devices, params, min(steps, task.steps), Path(scratch) / "ckpt")
        if not getattr(result, "ok", False):
            raise RuntimeError(f"profiling {task.name!r} with {technique} on {devices.count}: "
                               f"{getattr(result, 'error', result)}")
        times = step_seconds(result.run_dir)
    step = statistics.median(times[1:] or times)
    m = Measurement(step, max(result.peak_bytes), True, tuple(sorted(params.items())),
                    max(0.0, result.seconds - step * len(times)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step_seconds": m.step_seconds, "peak_bytes": m.peak_bytes,
                                "startup_seconds": m.startup_seconds, "job": task.name,
                                "technique": technique, "devices": devices.count, "params": params}))
    return m
