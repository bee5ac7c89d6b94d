"""The live table of ``fsdpx jobs run``: what each job is doing, read from its files.

A job's progress is read from the files the built-in techniques write (a user technique that
writes them is shown the same way): ``<job dir>/run/metrics.jsonl`` (one JSON line per step:
``step``, ``loss``, ``epsilon``, optionally ``elapsed_seconds``) and the checkpoints ``<job dir>/ckpt/step_<N>``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

from ckpt.manager import committed_steps


@dataclass(frozen=True)
class Progress:
    """The last step a job logged (0: none yet), its loss and epsilon, and ``seconds``: the job's
    own clock when it logged the step (its ``elapsed_seconds``; the built-ins: seconds since this
    attempt's loop began); NaN when not logged."""

    step: int = 0
    loss: float = math.nan
    epsilon: float = math.nan
    seconds: float = math.nan


def read_progress(job_dir: Path) -> Progress:
    """The last complete line of ``job_dir/run/metrics.jsonl`` (a line being written is
    skipped); ``Progress()`` when there is none."""
    path = Path(job_dir) / "run" / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))
            tail = f.read().decode(errors="replace")
    except FileNotFoundError:
        return Progress()
    for line in reversed(tail.splitlines()[1:] if size > 8192 else tail.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        num = lambda k: math.nan if row.get(k) is None else float(row[k])  # noqa: E731
        return Progress(int(row.get("step", 0)), num("loss"), num("epsilon"), num("elapsed_seconds"))
    return Progress()


def checkpoint_step(job_dir: Path) -> int:
    """The newest checkpointed step under ``job_dir/ckpt`` (0 when none): where a stopped job
    continues."""
    steps = committed_steps(Path(job_dir) / "ckpt")
    return steps[-1] if steps else 0


@dataclass(frozen=True)
class Row:
    job: str
    state: str
    technique: str
    devices: str
    step: int
    steps: int
    loss: float
    epsilon: float | None  # None for a job without privacy
    seconds: float


def format_table(rows: Sequence[Row], elapsed: float) -> str:
    """The table: one line per job, then the elapsed time."""
    head = f"{'job':<12} {'state':<8} {'technique':<22} {'devices':<9} {'step':>11} {'loss':>8} {'epsilon':>8} {'s':>7}"
    lines = [head]
    for r in rows:
        loss = f"{r.loss:8.4f}" if math.isfinite(r.loss) else f"{'-':>8}"
        eps = "" if r.epsilon is None else (f"{r.epsilon:8.3f}" if math.isfinite(r.epsilon) else f"{'-':>8}")
        lines.append(f"{r.job[:12]:<12} {r.state:<8} {r.technique[:22]:<22} {r.devices[:9]:<9} "
                     f"{f'{r.step}/{r.steps}':>11} {loss} {eps:>8} {r.seconds:7.1f}")
    lines.append(f"elapsed {elapsed:.1f} s")
    return "\n".join(lines)


class LiveTable:
    """Shows the table on ``stream``: on a terminal redrawn in place every ``refresh`` seconds;
    otherwise (a log, a pipe) printed whenever a job changes state and every ``log_every`` s."""

    def __init__(self, stream: IO[str], refresh: float = 1.0, log_every: float = 30.0):
        self.stream, self.refresh, self.log_every = stream, refresh, log_every
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._lines, self._last = 0, -math.inf

    def show(self, text: str, *, changed: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if not changed and now - self._last < self.refresh:
                return
            if self._lines:
                self.stream.write(f"\x1b[{self._lines}F\x1b[J")
            self._lines = text.count("\n") + 1
        elif not changed and now - self._last < self.log_every:
            return
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last = now
