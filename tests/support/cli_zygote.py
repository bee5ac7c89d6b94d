"""A process that has imported ``fsdpx train`` once and forks a real ``fsdpx train`` process per
request, so a test can start dozens of runs without paying Python's and torch's imports each time
(``tests/test_fault_injection.py``). The child runs the real command line, ``fsdpx.cli.main``,
in its own working directory with its stdout and stderr in files; signals sent to it are real.

    python -m support.cli_zygote          (OMP_NUM_THREADS=1: nothing parallel before a fork)
    stdin  {"argv": [...], "cwd": DIR, "out": FILE, "err": FILE, "env": {...}}   -> stdout: the child's pid
    stdin  "poll PID" -> its status, or "running"; "reap PID" -> its status (waits)

A status is the child's exit status, or minus the signal that killed it (``subprocess``'s
convention). Only imports happen here before a fork (no kernel has run, no thread started); every
child dies with this process, and this one with its parent.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import fsdpx.cli  # noqa: F401 - the imports every child would pay
import fsdpx.train.loop  # noqa: F401
from fsdpx.train.launch import die_with_parent


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _child(request: dict) -> None:
    code = 1
    try:
        die_with_parent()
        os.environ.update(request.get("env", {}))
        os.chdir(request["cwd"])
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(os.devnull)
        from fsdpx.cli import main

        main(request["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - shown as a run would show it
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    die_with_parent()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.startswith("{"):
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            print(pid, flush=True)
        elif line.startswith("poll "):
            pid, raw = os.waitpid(int(line.split()[1]), os.WNOHANG)
            print("running" if pid == 0 else _status(raw), flush=True)
        elif line.startswith("reap "):
            print(_status(os.waitpid(int(line.split()[1]), 0)[1]), flush=True)
        else:
            return


if __name__ == "__main__":
    main()
