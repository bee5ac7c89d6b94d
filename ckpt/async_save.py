"""Background saves: snapshot now, write later, at most one save in flight per rank.

``snapshot`` copies every tensor (detached, contiguous, on the CPU) before ``save`` returns, so
training may update its tensors in place right after; the non-tensor state is already a fresh
JSON tree. ``Saver.run`` starts the writing job in its own (non-daemon, so interpreter exit
waits for it) thread and returns a ``SaveHandle``; a new save first waits for the previous one
to finish, so at most one snapshot is held in memory and the commits happen in order.

Guarantees (``tests/test_ckpt_async.py``):
  * updates made after ``save(..., blocking=False)`` returns never reach the checkpoint
    (``test_async_snapshot_is_taken_before_save_returns``);
  * ``handle.wait()`` returns the committed path or re-raises the writer's exception
    (``test_async_wait_reraises_the_writer_error``);
  * a second save starts only after the first has finished (``test_at_most_one_save_in_flight``).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor


class SaveHandle:
    """The outcome of one save: ``wait()`` -> committed path (or the writer's exception)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None

    def _finish(self, path: Path | None, error: BaseException | None) -> None:
        self._path, self._error = path, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the save is committed; re-raise its error. ``None`` on ranks other
        than 0 is never returned: every rank gets the committed path."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._path

    @classmethod
    def completed(cls, path: Path) -> "SaveHandle":
        h = cls()
        h._finish(path, None)
        return h


def snapshot(tensors: dict[str, Tensor], spare: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """A private copy of every tensor: detached, contiguous, CPU. A buffer of ``spare`` with
    the same path, shape and dtype is reused (no fresh pages to fault in)."""
    spare = spare or {}
    out = {}
    for path, t in tensors.items():
        buf = spare.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        buf.copy_(t.detach())
        out[path] = buf
    return out


class Saver:
    """One rank's save slot (see module docstring)."""

    def __init__(self) -> None:
        self._last: SaveHandle | None = None
        self._lock = threading.Lock()
        self._spare: dict[str, Tensor] = {}

    def snapshot(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``snapshot`` into the buffers of this rank's previous async save. Safe: called only
        from ``make_job``, after that save has finished. The buffers stay allocated (one copy of
        the rank's state, like a staging buffer) for the next save."""
        self._spare = snapshot(tensors, self._spare)
        return self._spare

    def wait_idle(self) -> None:
        """Wait for the save in flight (its error, if any, stays with its own handle)."""
        last = self._last
        if last is not None:
            last._done.wait()

    def run(self, make_job: Callable[[], Callable[[], Path]], *, blocking: bool) -> SaveHandle:
        """Wait for the previous save, then ``job = make_job()`` (the snapshot happens here,
        in the caller's thread) and run ``job`` inline or in a new thread."""
        with self._lock:
            self.wait_idle()
            job = make_job()
            handle = SaveHandle()
            self._last = handle
            if blocking:
                _run_job(job, handle)
                return handle
            threading.Thread(target=_run_job, args=(job, handle), name="ckpt-save", daemon=False).start()
            return handle


def _run_job(job: Callable[[], Path], handle: SaveHandle) -> None:
    try:
        path = job()
    except BaseException as e:  # handed to whoever waits on the handle
        handle._finish(None, e)
    else:
        handle._finish(path, None)


_SAVERS: "weakref.WeakKeyDictionary[object, Saver]" = weakref.WeakKeyDictionary()
_SAVERS_LOCK = threading.Lock()


def saver_for(coordinator: object) -> Saver:
    """The save slot of the rank that ``coordinator`` speaks for."""
    with _SAVERS_LOCK:
        if coordinator not in _SAVERS:
            _SAVERS[coordinator] = Saver()
        return _SAVERS[coordinator]
