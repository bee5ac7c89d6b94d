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
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from .devices import Devices
from .gpt_job import gpt_task
from .task import Privacy, Task, check_unique_names


class JobsFileError(ValueError):
    """A jobs file that cannot be read as jobs; the message names the job and the key."""


def parse_jobs(text: str) -> tuple[list[Task], dict]:
    """The GPT jobs of a jobs file and its ``[cluster]`` table. Raises :class:`JobsFileError`
    for TOML errors, a job without name/steps/batch_size, an unknown key, and
    :class:`~fsdpx.jobs.task.DuplicateJobError` for repeated names."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise JobsFileError(f"not valid TOML: {e}") from None
    tasks = []
    for i, raw in enumerate(doc.get("job", [])):
        d = dict(raw)
        name = d.pop("name", None)
        missing = [k for k in ("steps", "batch_size") if k not in d]
        if name is None or missing:
            raise JobsFileError(f"job #{i + 1} ({name or 'no name'}) lacks {['name'] if name is None else missing}")
        privacy = d.pop("privacy", None)
        try:
            tasks.append(gpt_task(name, steps=d.pop("steps"), batch_size=d.pop("batch_size"),
                                  privacy=Privacy(**privacy) if privacy is not None else None, **d))
        except (TypeError, ValueError) as e:
            raise JobsFileError(f"job {name!r}: {e}") from None
    if not tasks:
        raise JobsFileError("the file has no [[job]]")
    return check_unique_names(tasks), dict(doc.get("cluster", {}))


def read_jobs(path: Path) -> tuple[list[Task], dict]:
    """``parse_jobs`` of the file at ``path``."""
    return parse_jobs(Path(path).read_text())


def cluster_of(table: dict, devices: int | None, memory_gib: float | None, default: Devices) -> Devices:
    """The planned cluster: flags over the file's ``[cluster]`` over this machine's ``default``."""
    count = devices or table.get("devices") or default.count
    mem = memory_gib or table.get("memory_gib")
    return Devices(int(count), int(mem * 2**30) if mem else default.memory_bytes, table.get("kind", default.kind))
