"""``jobs.toml``: the jobs and cluster of ``fsdpx jobs plan`` (parsing only; pure).

    [cluster]            # optional; --devices / --memory-gib override
    devices = 8
    memory_gib = 16

    [[job]]
    name = "small"
    steps = 300
    batch_size = 64
    n_layer = 2          # any fsdpx.jobs.gpt_job.HPARAMS key
    n_embd = 64

    [[job]]
    name = "private"
    steps = 200
    batch_size = 128
    privacy = { target_epsilon = 8.0, delta = 1e-5 }

    [[job]]              # a user's own model: three functions named "module:qualname"
    name = "mlp"
    model_fn = "mylab.jobs:model"
    data_fn = "mylab.jobs:points"
    loss_fn = "mylab.jobs:loss"
    steps = 300
    batch_size = 64
    hparams = { hidden = 32, n = 4096, lr = 0.05 }

A user job's modules import from this process's ``sys.path`` and from the jobs file's own
folder (added to ``sys.path`` by :func:`read_jobs`, as Python adds a script's folder); the
workers get the folder each module came from (``fsdpx.jobs.execute``).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from .devices import Devices
from .gpt_job import gpt_task
from .task import Privacy, Task, check_unique_names

USER_FUNCTIONS = ("model_fn", "data_fn", "loss_fn")


class JobsFileError(ValueError):
    """A jobs file that cannot be read as jobs; the message names the job and the key."""


def parse_jobs(text: str) -> tuple[list[Task], dict]:
    """The jobs of a jobs file and its ``[cluster]`` table: a GPT job of ``fsdpx train`` per
    ``[[job]]``, or a user's own job where the table names ``model_fn``, ``data_fn`` and
    ``loss_fn`` (``"module:qualname"``, imported here; ``hparams`` passed to them).

    Raises :class:`JobsFileError` for TOML errors, a job without name/steps/batch_size, an
    unknown key, a user job naming only some of the three functions, and a function that does
    not import (naming the job and the reference); :class:`~fsdpx.jobs.task.DuplicateJobError`
    for repeated names (``tests/test_jobs_cli.py::test_jobs_file_*``)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise JobsFileError(f"not valid TOML: {e}") from None
    tasks = [_task(i, dict(raw)) for i, raw in enumerate(doc.get("job", []))]
    if not tasks:
        raise JobsFileError("the file has no [[job]]")
    return check_unique_names(tasks), dict(doc.get("cluster", {}))


def _task(i: int, d: dict[str, Any]) -> Task:
    """The ``i``-th ``[[job]]`` table as a Task (``d`` is consumed)."""
    name = d.pop("name", None)
    missing = [k for k in ("steps", "batch_size") if k not in d]
    if name is None or missing:
        raise JobsFileError(f"job #{i + 1} ({name or 'no name'}) lacks {['name'] if name is None else missing}")
    privacy = d.pop("privacy", None)
    try:
        privacy = Privacy(**privacy) if privacy is not None else None
        if not any(k in d for k in USER_FUNCTIONS):
            return gpt_task(name, steps=d.pop("steps"), batch_size=d.pop("batch_size"), privacy=privacy, **d)
        return _user_task(name, d, privacy)
    except (TypeError, ValueError) as e:
        raise JobsFileError(f"job {name!r}: {e}") from None


def _user_task(name: str, d: dict[str, Any], privacy: Privacy | None) -> Task:
    """A user job: its three functions imported by reference (``resolve_ref``)."""
    from fsdpx.train.refs import NotImportableError, resolve_ref

    lacking = [k for k in USER_FUNCTIONS if k not in d]
    if lacking:
        raise JobsFileError(f"job {name!r}: a user job names all of {list(USER_FUNCTIONS)}; lacks {lacking}")
    try:
        fns = [resolve_ref(str(d.pop(k))) for k in USER_FUNCTIONS]
    except NotImportableError as e:
        raise JobsFileError(f"job {name!r}: {e}") from None
    steps, batch_size, hparams = d.pop("steps"), d.pop("batch_size"), d.pop("hparams", {})
    if d:
        raise JobsFileError(f"job {name!r}: unknown keys {sorted(d)} (a user job takes name, steps, batch_size,"
                            f" {', '.join(USER_FUNCTIONS)}, hparams, privacy)")
    if not isinstance(hparams, dict):
        raise JobsFileError(f"job {name!r}: hparams must be a table, got {hparams!r}")
    return Task(name, *fns, steps=steps, batch_size=batch_size, privacy=privacy, hparams=hparams)


def read_jobs(path: Path) -> tuple[list[Task], dict]:
    """``parse_jobs`` of the file at ``path``, with the file's folder on ``sys.path`` (appended,
    once) so that its user jobs' modules import from beside it."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    return parse_jobs(Path(path).read_text())


def cluster_of(table: dict, devices: int | None, memory_gib: float | None, default: Devices) -> Devices:
    """The planned cluster: flags over the file's ``[cluster]`` over this machine's ``default``."""
    count = devices or table.get("devices") or default.count
    mem = memory_gib or table.get("memory_gib")
    return Devices(int(count), int(mem * 2**30) if mem else default.memory_bytes, table.get("kind", default.kind))
