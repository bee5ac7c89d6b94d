"""An audit inside ``fsdpx train`` (``--audit-canaries M``): the run's gradient canaries, their
starting values, and the report its summary and plot end with.

The canaries (:class:`privacy.gradient_canaries.GradientCanaries`) are drawn from the noise key,
which travels in the checkpoint, so every segment of a run adds the same ones. Their
coordinates' values before step 1 are written to ``audit.json`` in the run directory when the
run starts, and read back from the earlier run directory when it resumes or branches (a
resumed segment may re-seed, which would build another untrained model). At the end each
canary's score is how far its coordinate moved down, and :func:`privacy.audit.judge` turns
them into the one-run bound beside the epsilon the accountant reports for the whole run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from torch import Tensor

from privacy.audit import AuditReport, audit_gradient_canaries
from privacy.gradient_canaries import GradientCanaries
from privacy.step import DPConfig

from .errors import ConfigError

AUDIT_FILE = "audit.json"


def with_canaries(dp: DPConfig, count: int, params: dict[str, Tensor], key: int) -> DPConfig:
    """``dp`` whose steps add ``count`` gradient canaries over ``params`` (every trainable
    parameter, in the model's order; shapes only are read: meta tensors do), drawn from ``key``."""
    canaries = GradientCanaries(count=count, key=key, norm=dp.clip_norm, sample_rate=dp.sample_rate,
                                params=tuple((n, p.numel()) for n, p in params.items()))
    return dataclasses.replace(dp, canaries=canaries)


def starting_values(canaries: GradientCanaries, fresh: dict[str, Tensor] | None, earlier_run_dir: Path | None
                    ) -> np.ndarray:
    """The canaries' coordinates before step 1: read from the whole untrained parameters
    ``fresh`` when the run starts now, else from the earlier run directory's ``audit.json``.
    A resumed run whose directory has none, or other canaries, raises :class:`ConfigError`
    (before anything is written)."""
    if fresh is not None:
        return canaries.values(fresh)
    path = (earlier_run_dir or Path(".")) / AUDIT_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"audit_canaries: the run being continued has no readable {path} ({err}); its canaries'"
                          " starting values are lost: resume without --audit-canaries") from err
    if (record.get("count"), record.get("key")) != (canaries.count, canaries.key):
        raise ConfigError(f"audit_canaries: {path} holds other canaries (count {record.get('count')}, key"
                          f" {record.get('key')}); this run's are count {canaries.count}, key {canaries.key}")
    return np.array(record["initial"], dtype=np.float64)


def write_starting_values(run_dir: Path, canaries: GradientCanaries, initial: np.ndarray) -> None:
    """``audit.json``: the canaries' count, key and starting values, for the run's later segments."""
    (run_dir / AUDIT_FILE).write_text(json.dumps({"count": canaries.count, "key": canaries.key,
                                                  "initial": [float(x) for x in initial]}))


def report(canaries: GradientCanaries, initial: np.ndarray, trained: dict[str, Tensor], *, epsilon: float,
           delta: float) -> AuditReport:
    """The audit of the trained parameters against the run's ``epsilon`` at ``delta``."""
    return audit_gradient_canaries(canaries, initial, canaries.values(trained), claimed_epsilon=epsilon,
                                   delta=delta)
