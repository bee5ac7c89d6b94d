"""Helpers the benchmark scripts share: a progress log, clocks, byte sizes, the per-step counter
of collectives and phases, the process's peak-memory marks (``/proc/self/status`` VmHWM, reset
through ``/proc/self/clear_refs``), paired ratios and table cells, and the torchrun launch of a
benchmark's workers."""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable


def logger(name: str | None = None) -> Callable[[str], None]:
    """A ``log(msg)`` that prints ``[name HH:MM:SS] msg`` (``[HH:MM:SS] msg`` without a name) to
    stderr at once: a benchmark's progress, kept apart from the results it prints on stdout."""
    prefix = f"{name} " if name else ""

    def log(msg: str) -> None:
        print(f"[{prefix}{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def clocks() -> tuple[float, float]:
    """(wall seconds, process CPU seconds of every thread)."""
    return time.perf_counter(), time.process_time()


def nbytes(t) -> int:
    """The bytes of tensor ``t``'s elements."""
    return t.numel() * t.element_size()


def seeded_gpt(cfg: dict):
    """fsdpx's ``GPT(GPTConfig(**cfg))`` with its weights drawn under seed 0: the same model in
    every mode and process (on the device in scope, meta included)."""
    import torch

    from fsdpx.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def random_token_batch(cfg: dict, size: int):
    """``(inputs, targets)``: ``size`` sequences of ``cfg["block_size"]`` random tokens below
    ``cfg["vocab_size"]`` each, drawn under seed 1: the same batch in every process."""
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (size, cfg["block_size"])
    return (torch.randint(0, cfg["vocab_size"], shape, generator=g),
            torch.randint(0, cfg["vocab_size"], shape, generator=g))


def status_kb(field: str) -> int:
    """This process's ``field`` of ``/proc/self/status`` in kB (``VmRSS``, ``VmHWM``); KeyError
    where it has none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_hwm() -> bool:
    """Reset this process's peak resident set (``VmHWM``); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Counter:
    """Bytes, calls and seconds per collective kind, and seconds per named phase, of one step: a
    benchmark's wrappers around the collectives ``add`` to it, and ``timed`` functions add their
    phase, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall
        self.cpu: dict[str, float] = {}  # process CPU time (every thread)

    def add(self, kind: str, nbytes: int, t0: tuple[float, float]) -> None:
        """One collective of ``kind`` moving ``nbytes``, begun at ``t0`` (``clocks()``)."""
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.add_time(kind, t0)

    def phase(self, name: str, t0: tuple[float, float]) -> None:
        """Phase ``name``, begun at ``t0``, ends now."""
        self.add_time("phase:" + name, t0)

    def add_time(self, key: str, t0: tuple[float, float]) -> None:
        """The wall and CPU seconds from ``t0`` to now, added to ``key``'s."""
        wall, cpu = clocks()
        self.seconds[key] = self.seconds.get(key, 0.0) + wall - t0[0]
        self.cpu[key] = self.cpu.get(key, 0.0) + cpu - t0[1]

    def timed(self, name: str, fn: Callable, marks: MemMarks, *, before: str | None = None,
              after: str | None = None) -> Callable:
        """``fn`` with its seconds added to phase ``name`` (while ``active``), and ``marks``
        marked ``before`` and ``after`` it."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if before:
                marks.mark(before)
            t0 = clocks()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.phase(name, t0)
                if after:
                    marks.mark(after)
        return wrapper

    def record(self) -> dict[str, dict]:
        """What was counted since ``reset``: ``bytes`` and ``calls`` per kind, and wall and CPU
        seconds per collective kind (``coll_seconds``, ``coll_cpu``) and per phase (``phases``,
        ``phases_cpu``)."""
        return {"bytes": dict(self.bytes), "calls": dict(self.calls),
                "coll_seconds": {k: v for k, v in self.seconds.items() if not k.startswith("phase:")},
                "phases": {k[6:]: v for k, v in self.seconds.items() if k.startswith("phase:")},
                "coll_cpu": {k: v for k, v in self.cpu.items() if not k.startswith("phase:")},
                "phases_cpu": {k[6:]: v for k, v in self.cpu.items() if k.startswith("phase:")}}


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


def median_ratio(values: list[float], refs: list[float]) -> float:
    """The median over paired rounds of ``value / ref`` (``zip``: as many rounds as the shorter
    list has). Two modes of one round run back to back, so a load that drifts between rounds
    cancels."""
    return statistics.median(v / r for v, r in zip(values, refs))


def paired_ratio(t: dict, mode: str, ref: str, key: str) -> str:
    """A table cell: ``median_ratio`` of ``t[mode][key]`` over ``t[ref][key]`` (per-round step
    times), as ``1.23x``; ``-`` when ``ref`` was not measured."""
    if ref not in t:
        return "-"
    return f"{median_ratio(t[mode][key], t[ref][key]):.2f}x"


def per_rank_cell(values: list, fmt: Callable[[Any], str]) -> str:
    """A table cell of one value per rank: ``fmt`` of it once when every rank's reads the same,
    else each rank's, `` / ``-separated."""
    cells = [fmt(v) for v in values]
    return cells[0] if len(set(cells)) == 1 else " / ".join(cells)


def write_report(path: str | None, results: dict, table: str) -> None:
    """Every number of ``results`` and the printed ``table``, as JSON at ``path``; nothing
    without a path."""
    if path:
        with open(path, "w") as f:
            json.dump({**results, "table": table}, f, indent=1)


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
