"""Starting local processes for a multi-process run (the impure edge of ``fsdpx train --nproc``).

``torchrun_command`` builds the torchrun call a user would type; ``spawn_ranks`` starts ranks
directly with the rendezvous environment torchrun would set, without torchrun's agent (which
kills every rank as soon as one fails), so tests can watch survivors report a dead peer.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Sequence


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, argv: Sequence[str], *, module: bool = False) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [-m] argv...``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return cmd + (["-m"] if module else []) + list(argv)


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
