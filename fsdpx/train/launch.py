"""Starting local processes for a multi-process run (the impure edge of ``fsdpx train --nproc``).

``torchrun_command`` builds the torchrun call a user would type; ``spawn_ranks`` starts ranks
directly with the rendezvous environment torchrun would set, without torchrun's agent (which
kills every rank as soon as one fails), so tests can watch survivors report a dead peer.

Workers never outlive their launcher (issue 14): ``launch`` starts torchrun with
``die_with_parent`` (Linux ``PR_SET_PDEATHSIG``: the kernel sends SIGKILL when the launcher
dies, however it dies) and ``LAUNCHER_PID`` in its environment; each worker calls
``watch_launcher``, which sets the same on itself (torchrun killed -> its workers killed) and
polls the launcher's pid, covering the moment before ``prctl`` and a torchrun that survived.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
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
    """Run ``cmd`` (torchrun) as a child that dies with this process; its exit code. Its
    workers find this process's pid in ``FSDPX_LAUNCHER_PID``."""
    env = {**os.environ, LAUNCHER_PID: str(os.getpid())}
    return subprocess.call(list(cmd), env=env, preexec_fn=die_with_parent)


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
