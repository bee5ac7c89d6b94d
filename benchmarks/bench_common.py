"""Helpers the benchmark scripts share: clocks, byte sizes, and the process's peak-memory marks
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable


def clocks() -> tuple[float, float]:
    """(wall seconds, process CPU seconds of every thread)."""
    return time.perf_counter(), time.process_time()


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemMarks:
    """Peak RSS per phase of a step (memory jobs only): ``mark(phase)`` reads ``VmHWM`` (the
    peak since the previous mark) and resets it, so the overall peak is the max of the marks."""

    def __init__(self) -> None:
        self.active = False
        self.peaks: dict[str, int] = {}
        self.overall = 0

    def mark(self, phase: str) -> None:
        if self.active:
            hwm = status_kb("VmHWM")
            self.peaks[phase] = max(self.peaks.get(phase, 0), hwm)
            self.overall = max(self.overall, hwm)
            reset_hwm()


def launch_worker(script: str, worker_args: list[str], env_extra: dict[str, str], nproc: int,
                  log: Callable[[str], None]) -> dict:
    """Run ``script`` under torchrun on ``nproc`` processes (one thread each) with
    ``worker_args --result PATH``, and return the JSON rank 0 wrote to PATH. A worker that exits
    non-zero AFTER writing its complete result (gloo can abort in C++ teardown) keeps the
    result, with ``exit_code`` set and a line logged."""
    from fsdpx.train.launch import torchrun_command

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = torchrun_command(nproc, [script, *worker_args, "--result", path])
        env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            proc.check_returncode()
            raise
        if proc.returncode:
            log(f"worker exited with code {proc.returncode} AFTER writing its complete result; result kept")
            result["exit_code"] = proc.returncode
        return result
