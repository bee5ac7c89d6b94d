"""Starting local processes for a multi-process run (the impure edge of ``fsdpx train --nproc``).

``torchrun_command`` builds the torchrun call a user would type; ``spawn_ranks`` starts ranks
directly with the rendezvous environment torchrun would set, without torchrun's agent (which
kills every rank as soon as one fails), so tests can watch survivors report a dead peer.

Workers never outlive their launcher (issue 14): ``launch`` starts torchrun with
``die_with_parent`` (Linux ``PR_SET_PDEATHSIG``: the kernel sends SIGKILL when the launcher
dies, however it dies) and ``LAUNCHER_PID`` in its environment; each worker calls
``watch_launcher``, which sets the same on itself (torchrun killed -> its workers killed) and
polls the launcher's pid, covering the moment before ``prctl`` and a torchrun that survived.

One line, once (issue 28): ``launch`` runs torchrun through :mod:`fsdpx.train.agent` (torchrun
without its log lines and failure banners unless ``FSDPX_VERBOSE``), in a session of its own (a
Ctrl-C in the terminal reaches the launcher only), forwards SIGINT and SIGTERM to it (torchrun
passes them on to every worker and waits for them), and, once it is done, prints the one line
the workers' reports and torchrun's account call for (:func:`fsdpx.train.reports.choose`) and
returns its exit status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

LAUNCHER_PID = "FSDPX_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, argv: Sequence[str], *, module: bool = False, max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts R] [-m] argv...``.

    With ``max_restarts`` > 0 torchrun's agent, on any worker's failure, stops every worker and
    starts them all again, up to that many times; the restarted workers see
    ``TORCHELASTIC_RESTART_COUNT`` (:func:`restart_count`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + (["-m"] if module else []) + list(argv)


def restart_count() -> int:
    """How many times torchrun has restarted this worker's group (0 on the first attempt or
    outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def spawn_ranks(nproc: int, argv: Sequence[str], *, env: dict | None = None) -> list[subprocess.Popen]:
    """Start ``nproc`` processes ``python argv...`` with RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR=127.0.0.1 and a free MASTER_PORT set; returns them (the caller waits)."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        e = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``; kept
    across ``exec``). Returns whether it was set: False off Linux, where nothing is done."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def launch(cmd: Sequence[str]) -> int:
    """Run the torchrun command ``cmd`` (:func:`torchrun_command`) through the quiet agent, as a
    child that dies with this process, in its own session; returns the run's exit status, having
    printed its one line on stderr when it failed or was interrupted (see the module doc). Its
    workers find this process's pid in ``FSDPX_LAUNCHER_PID`` and where to report in
    ``FSDPX_REPORT_DIR``.

    Guarantees: SIGINT and SIGTERM are forwarded (every worker stops after the same step; the
    line is rank 0's, as a one-process run prints it), and this returns at most the grace period
    plus 15 s after the first one (the agent is killed then, and its workers with it)
    (``tests/test_fault_injection.py``)."""
    from .interrupts import grace_seconds
    from .reports import REPORT_DIR, choose, read, read_agent

    grace = grace_seconds()
    cmd = list(cmd)
    at = cmd.index("torch.distributed.run")
    cmd[at:at + 1] = ["fsdpx.train.agent", f"--shutdown-timeout={int(grace) + 5}"]
    with tempfile.TemporaryDirectory(prefix="fsdpx-reports-") as reports:
        env = {**os.environ, LAUNCHER_PID: str(os.getpid()), REPORT_DIR: reports}
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, start_new_session=True)
        signaled: list[int] = []

        def forward(signum: int, frame: object) -> None:
            signaled.append(signum)
            proc.send_signal(signum)

        handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            returncode = _wait(proc, signaled, grace + 15)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        outcome = choose(read(Path(reports)), read_agent(Path(reports)), signaled[0] if signaled else None,
                         returncode)
    if outcome is None:
        return 0
    line, code, traceback = outcome
    if traceback:
        print(traceback, file=sys.stderr, end="")
    print(line, file=sys.stderr, flush=True)
    return code


def _wait(proc: subprocess.Popen, signaled: list[int], bound: float) -> int:
    """``proc``'s exit status; once ``signaled`` holds a signal, at most ``bound`` seconds more
    (then it is killed)."""
    deadline = None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if signaled and deadline is None:
                deadline = time.monotonic() + bound
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()


def watch_launcher(interval: float = 0.5) -> bool:
    """In a worker started by :func:`launch`: die with the parent (torchrun), and with the
    launcher, checked every ``interval`` seconds by a daemon thread (SIGKILL to this process
    once it is gone: nothing more is written). Returns False when not started by ``launch``."""
    pid = os.environ.get(LAUNCHER_PID)
    if pid is None:
        return False
    die_with_parent()
    launcher = int(pid)

    def watch() -> None:
        while _alive(launcher):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fsdpx-launcher-watch", daemon=True).start()
    return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
