"""Preemption and Ctrl-C: a signal asks the run to stop at the next step boundary (the impure
edge of signals, a clock and a hard exit; ``fsdpx train`` installs it, the loop asks it).

    with handling():             # fsdpx train, first thing, in the main thread
        ...
    signum = agreed(comm)        # the loop, before each step: None, SIGINT or SIGTERM

* SIGTERM (a scheduler's preemption): the step under way finishes, the run writes a checkpoint
  at that step when it has a ``--ckpt-dir``, says ``interrupted at step N; newest checkpoint
  ...`` and exits 143. From the first SIGTERM on, a watchdog gives the run ``grace_seconds()``
  (``FSDPX_GRACE_SECONDS``, default 25: inside the 30 s that Kubernetes and Slurm wait before
  SIGKILL); a run still going then (a checkpoint that did not finish) says so, with the newest
  intact checkpoint, and exits 143 at once: a checkpoint is atomic, so the abandoned one leaves
  nothing behind.
* SIGINT (Ctrl-C): the step under way finishes, nothing more is written, the same line, exit
  130. A second Ctrl-C abandons the step (``KeyboardInterrupt``), still exit 130 with the line.
* Sharded: every rank gets the signal (the launcher forwards it through torchrun), but not at
  the same instant; ``agreed`` gathers each rank's request before every step, so all ranks stop
  after the same step (SIGTERM wins over SIGINT: the checkpoint is the safe choice).

Outside ``handling`` (the Python entry ``fsdpx.train.run``, ``fsdpx jobs`` workers) nothing is
requested and the loop runs as before. Edge cases: a signal before ``handling`` began (Python
still importing) ends the process the default way; a signal after the last step's check leaves
the finished run alone. Proved by ``tests/test_fault_injection.py`` (the grace period:
``test_a_stop_that_outlasts_the_grace_period_ends_it_there``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The exit status of a run stopped by each signal: 128 + the signal's number, as a shell reports
a process the signal killed."""

GRACE = "FSDPX_GRACE_SECONDS"
_DEFAULT_GRACE = 25.0

_received: list[int] = []
_installed = False
_over = threading.Event()  # set when the handling block ends
_where: Callable[[], tuple[int | None, str | None, str | None]] | None = None  # the watchdog's step and checkpoint


class Interrupted(Exception):
    """The run stopped on a signal. ``line``: ``interrupted at step N; newest checkpoint ...``
    (the same in one process and sharded); ``code``: the exit status (130 or 143)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line, self.code = line, code


def grace_seconds() -> float:
    """Seconds a run has after the first SIGTERM before the watchdog ends it: ``FSDPX_GRACE_SECONDS``
    (a number > 0), else 25."""
    try:
        value = float(os.environ.get(GRACE, _DEFAULT_GRACE))
    except ValueError:
        return _DEFAULT_GRACE
    return value if value > 0 else _DEFAULT_GRACE


@contextlib.contextmanager
def handling() -> Iterator[bool]:
    """Handle SIGINT and SIGTERM inside the block (see the module doc), then put back the handlers
    there were and forget what was received (a process may run ``fsdpx train`` more than once:
    the tests). Yields False, doing nothing, outside the main thread (Python delivers signals only
    there)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    before = {sig: signal.signal(sig, _handle) for sig in EXIT_CODES}
    _received.clear()
    _over.clear()
    _installed = True
    try:
        yield True
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        _installed = False
        _over.set()  # a watchdog still waiting has nothing left to bound
        _received.clear()
        on_grace_over(None)


def installed() -> bool:
    """Whether :func:`handling` holds the signals of this process now."""
    return _installed


def _handle(signum: int, frame: Any) -> None:
    first = not _received
    _received.append(signum)
    if signum == signal.SIGTERM and signal.SIGTERM not in _received[:-1]:
        threading.Thread(target=_watchdog, args=(grace_seconds(),), name="fsdpx-grace", daemon=True).start()
    if not first and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: abandon the step under way


def requested() -> int | None:
    """The signal that asked this process to stop (SIGTERM if both came), or ``None``."""
    if not _received:
        return None
    return signal.SIGTERM if signal.SIGTERM in _received else signal.SIGINT


def agreed(comm: Any = None) -> int | None:
    """:func:`requested`, agreed by every rank of ``comm`` (one all-gather of one number, not
    counted as the step's communication): the same answer on every rank, SIGTERM when any rank
    has it. Call it on every rank at the same point of the loop."""
    mine = requested()
    if comm is None:
        return mine
    floats = getattr(comm, "all_gather_floats", None)  # a DistComm's: one float64 all-gather
    everyone = [int(r[0]) for r in floats([float(mine or 0)])] if floats is not None else \
        comm.all_gather_object(mine or 0)
    return max(everyone) or None


def exit_code(signum: int) -> int:
    """The exit status of a run that ``signum`` stopped (``EXIT_CODES``)."""
    return EXIT_CODES[signal.Signals(signum)]


def line(step: int | None, ckpt_dir: str | None, newest: str | None, note: str = "") -> str:
    """The one line a stopped run says: ``interrupted at step N; newest checkpoint DIR/step_M
    (continue with --resume)``, or ``newest checkpoint: none in DIR`` / ``none (no --ckpt-dir)``;
    ``note`` follows the step, in parentheses. ``step`` ``None``: stopped before the segment knew
    its first step. Pure."""
    at = "interrupted before the first step" if step is None else f"interrupted at step {step}"
    at += f" ({note})" if note else ""
    if ckpt_dir is None:
        return f"{at}; newest checkpoint: none (no --ckpt-dir)"
    if newest is None:
        return f"{at}; newest checkpoint: none in {ckpt_dir}"
    return f"{at}; newest checkpoint {newest} (continue with --resume)"


def on_grace_over(where: Callable[[], tuple[int | None, str | None, str | None]] | None) -> None:
    """What the watchdog says when the grace period ends: ``where()`` -> ``(step, ckpt_dir,
    newest)`` as :func:`line` takes them; the loop keeps it current."""
    global _where
    _where = where


def where() -> tuple[int | None, str | None, str | None] | None:
    """The loop's ``(step, ckpt_dir, newest)`` now (see :func:`on_grace_over`), or ``None``
    before a loop started in this :func:`handling` block."""
    return _where() if _where is not None else None


def _watchdog(seconds: float) -> None:
    if _over.wait(seconds):
        return
    from ckpt.commit import hold_commits  # loaded by then (a run that saves imported ckpt)

    hold_commits()  # the newest checkpoint named below stays the newest until the exit (waits <= 5 s)
    step, ckpt_dir, newest = where() or (None, None, None)
    note = f"grace period over: {GRACE}={seconds:g}"
    from .reports import announce  # the rank's report, or the line on stderr

    announce("interrupted", line(step, ckpt_dir, newest, note), EXIT_CODES[signal.SIGTERM])
    sys.stderr.flush()
    os._exit(EXIT_CODES[signal.SIGTERM])
