"""Where a job's attempt runs: a forked local process (``LocalBackend``) or a Ray task
(``RayBackend``, ``ray_backend.py``). Both run :func:`run_attempt`, the same worker.

An attempt is one call of the technique's ``execute(task, devices, params, steps, ckpt_dir)``
on a device group. The local backend forks one process per attempt, in its own process group,
pinned to the group's devices (CPU cores by ``os.sched_setaffinity``, GPUs by
``CUDA_VISIBLE_DEVICES``) and dying with the runner (``die_with_parent``); torchrun and its
workers, started by ``execute.launch``, die with it in turn. ``stop`` kills the group: the job
continues later from its last checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from fsdpx.train.launch import die_with_parent

from . import techniques
from .devices import Devices
from .task import Task


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job: ``technique`` with ``params`` on ``devices`` (whose ``ids`` are the
    physical ones: CPU cores or GPU indices), training up to step ``steps`` from ``ckpt_dir``."""

    task: Task
    technique: str
    devices: Devices
    params: Mapping[str, Any]
    steps: int
    ckpt_dir: Path


def outcome_of(result: Any) -> tuple[bool, str | None]:
    """``(ok, error)`` of what ``execute`` returned: a result with ``ok`` False (a process group
    that exited non-zero) is a failure with its ``error``; anything else is a success."""
    ok = bool(getattr(result, "ok", True))
    return ok, None if ok else (getattr(result, "error", None) or f"the job failed: {result!r}")


def pin(devices: Devices) -> None:
    """Restrict this process (and what it starts) to ``devices.ids``: CPU affinity, or the
    visible GPUs. Nothing when ``ids`` is None."""
    if devices.ids is None:
        return
    if devices.kind == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, sorted(set(devices.ids))))
    elif hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(devices.ids))


def run_attempt(attempt: Attempt, technique: Any = None) -> Any:
    """Pin this process to the attempt's devices and call the technique's ``execute``; returns
    its result (exceptions propagate). The worker both backends run. ``technique`` is the object
    to run (default: the one registered as ``attempt.technique`` in this process; the Ray
    backend passes the driver's, so a technique registered only there runs on the cluster)."""
    pin(attempt.devices)
    tech = technique if technique is not None else techniques.get(attempt.technique)
    return tech.execute(attempt.task, attempt.devices, dict(attempt.params), attempt.steps, attempt.ckpt_dir)


def error_text(e: BaseException) -> str:
    """``Type: message`` and the traceback's last lines."""
    tail = "".join(traceback.format_exception(e)[-6:])
    return f"{type(e).__name__}: {e}\n{tail}"


class Handle(Protocol):
    def poll(self) -> tuple[str, Any] | None:
        """None while running; then ``("ok", result)`` or ``("error", text)``."""

    def stop(self) -> None:
        """End the attempt now (its processes killed)."""


class LocalBackend:
    """Attempts as forked processes of this one (``fork``: the task's functions, lambdas
    included, and the registry come along unpickled)."""

    name = "local"

    def start(self, attempt: Attempt) -> "LocalHandle":
        return LocalHandle(attempt)

    def close(self) -> None:
        pass


def _attempt_main(conn, parent: int, attempt: Attempt, technique: Any = None) -> None:
    os.setpgid(0, 0)  # its own process group: stop() kills it and the torchrun it started at once
    die_with_parent()
    if os.getppid() != parent:  # the runner died before prctl
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        msg = ("ok", run_attempt(attempt, technique))
    except BaseException as e:  # noqa: BLE001 -- reported as the job's error, never raised in the runner
        msg = ("error", error_text(e))
    try:
        conn.send(msg)
    except Exception as e:  # an unpicklable result
        conn.send(("ok", repr(msg[1])) if msg[0] == "ok" else ("error", f"{msg[1]} (and {e})"))
    conn.close()


class LocalHandle:
    """A running attempt in a forked process (running ``technique``, default the registered one)."""

    def __init__(self, attempt: Attempt, technique: Any = None):
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_attempt_main, args=(send, os.getpid(), attempt, technique), daemon=True,
                                   name=f"fsdpx-job-{attempt.task.name}")
        self.process.start()
        send.close()

    def poll(self) -> tuple[str, Any] | None:
        alive = self.process.is_alive()  # before reading: a process that is gone has sent all it will
        if self._recv.poll():
            try:
                msg = self._recv.recv()
            except EOFError:
                msg = None
            if msg is not None:
                self.process.join()
                return msg
        if alive:
            return None
        self.process.join()
        return "error", f"the job's process exited with code {self.process.exitcode} before reporting a result"

    def stop(self) -> None:
        pid = self.process.pid
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not yet its own group leader
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join()
        self._recv.close()
