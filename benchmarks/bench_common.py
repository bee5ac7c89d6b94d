"""Helpers the benchmark scripts share: clocks, byte sizes, and the process's peak-memory marks
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``)."""

from __future__ import annotations

import time


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
