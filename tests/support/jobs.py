"""Helpers shared by the jobs tests: waiting for an attempt, reading a run's losses."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait(handle, timeout: float = 300):
    """What a backend attempt's ``handle.poll()`` returns once it has ended; fails the test
    after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (msg := handle.poll()) is None:
        assert time.monotonic() < end, "attempt did not finish"
        time.sleep(0.1)
    return msg


def run_losses(run_dir: Path) -> list[float]:
    """The per-step losses a run logged in ``run_dir/metrics.jsonl``."""
    return [json.loads(r)["loss"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
