"""How a run ends, said once: the one line and exit status of a refusal, a failure or an
interruption, in one process and in a sharded run.

One process prints its own line. A worker of ``fsdpx train --nproc`` (``FSDPX_REPORT_DIR`` set by
the launcher, :mod:`fsdpx.train.launch`) writes it instead as a report, ``<dir>/attempt_<A>_rank_<R>.json``,
and exits with its status; once torchrun is done the launcher reads the reports of the last
attempt, with torchrun's own account of the processes it saw die (``agent.json``, written by
:mod:`fsdpx.train.agent`), and prints one line (:func:`choose`):

    fsdpx train: error: rank 1: <the line of the first rank that failed>      exit 2 or 1
    fsdpx train: error: rank 1: killed by SIGKILL                               exit 1
    fsdpx train: interrupted at step 7; newest checkpoint ck/step_7 (...)     exit 143 or 130

Exit statuses, the same in one process and sharded: 2 a refusal (a value or a change the run
cannot honour, before training), 1 a failure during the run (a checkpoint that could not be
saved, a rank that died, a bug), 130 SIGINT, 143 SIGTERM (:mod:`fsdpx.train.interrupts`).
``--verbose`` or ``FSDPX_VERBOSE=1`` shows every rank's own output and torchrun's as well.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

REPORT_DIR = "FSDPX_REPORT_DIR"
VERBOSE = "FSDPX_VERBOSE"
AGENT = "agent.json"

KINDS = ("refusal", "failure", "interrupted")


class Report(NamedTuple):
    """One rank's account of how it ended. ``kind``: one of ``KINDS``; ``code``: its exit status;
    ``detail``: the line without ``fsdpx train: error:``; ``time``: when (``time.time()``);
    ``secondary``: a consequence of another rank's failure (it named a peer that died, or was
    stopped by torchrun after one); ``traceback``: a bug's, shown once by the launcher."""

    rank: int
    kind: str
    code: int
    detail: str
    time: float
    secondary: bool = False
    traceback: str | None = None


def verbose() -> bool:
    """Whether ``FSDPX_VERBOSE`` asks for every rank's and torchrun's output (``--verbose`` sets it)."""
    return os.environ.get(VERBOSE, "") not in ("", "0")


def text(kind: str, detail: str, rank: int | None = None) -> str:
    """The line printed on stderr: ``fsdpx train: error: [rank R: ]DETAIL`` for a refusal or a
    failure, ``fsdpx train: DETAIL`` for an interruption (no rank: every rank stopped together)."""
    if kind == "interrupted":
        return f"fsdpx train: {detail}"
    return f"fsdpx train: error: {'' if rank is None else f'rank {rank}: '}{detail}"


def rank_of_this_process() -> int | None:
    """This process's rank in a torchrun-started run (``RANK``), else ``None``."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def announce(kind: str, detail: str, code: int, *, secondary: bool = False, traceback: str | None = None) -> None:
    """Say how this process ends: a worker of the launcher writes its report (and prints the
    line too when verbose); any other process prints the line (a rank of a sharded run started
    otherwise, naming itself; an interruption on rank 0 only). Never raises."""
    rank = rank_of_this_process()
    where = os.environ.get(REPORT_DIR)
    if where is not None and rank is not None:
        try:
            write(Path(where), Report(rank, kind, code, detail, time.time(), secondary, traceback))
        except OSError:
            where = None
    if where is None or verbose():
        if traceback and where is None:
            print(traceback, file=sys.stderr, end="")
        if kind != "interrupted" or not rank:
            print(text(kind, detail, rank), file=sys.stderr, flush=True)


def write(directory: Path, report: Report) -> Path:
    """Write ``report`` atomically as ``attempt_<A>_rank_<R>.json`` (``A``: torchrun's restart count)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = directory / f"attempt_{attempt}_rank_{report.rank}.json"
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report._asdict()))
    os.replace(tmp, path)
    return path


def read(directory: Path) -> list[Report]:
    """The reports of the last attempt that wrote any, in rank order."""
    found: dict[int, list[Report]] = {}
    for path in Path(directory).glob("attempt_*_rank_*.json"):
        attempt = int(path.name.split("_")[1])
        try:
            found.setdefault(attempt, []).append(Report(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found[max(found)], key=lambda r: r.rank) if found else []


def read_agent(directory: Path) -> dict[str, Any] | None:
    """torchrun's account of the failed workers of its last attempt (``agent.json``): ``{"failures":
    [{"rank", "exitcode", "signal"}...], "first": rank}``, or ``None``."""
    try:
        return json.loads((Path(directory) / AGENT).read_text())
    except (OSError, ValueError):
        return None


def choose(reports: Sequence[Report], agent: Mapping[str, Any] | None, signaled: int | None,
           returncode: int) -> tuple[str, int, str | None] | None:
    """The one line, exit status and traceback (a bug's, else ``None``) a sharded run ends with;
    ``None`` when it succeeded (torchrun's ``returncode`` 0). Pure.

    * The launcher got a signal (``signaled``): rank 0's interruption line (ranks agree on the
      step), else the lowest rank's; with none, a failure report; else ``interrupted``.
    * Otherwise, the first rank that failed: the earliest report that is not ``secondary``
      (a rank's own refusal or failure); else a rank that died without a word (killed by a
      signal, in torchrun's account), named with the signal, exit 1; else the earliest
      secondary report (a rank that saw a peer die names it); else torchrun's first failure's
      exit status. An interruption reported without a signal to the launcher is torchrun
      stopping the others after a failure: secondary.

    Edge cases: reports of earlier attempts (``--max-restarts``) are not passed (:func:`read`);
    ties in time go to the lower rank.
    ``tests/test_fault_injection.py::test_the_launcher_names_the_first_failing_rank``."""
    if returncode == 0:  # every worker finished (a signal that came after their last step changes nothing)
        return None
    if signaled is not None:
        stops = [r for r in reports if r.kind == "interrupted"]
        if stops:
            first = min(stops, key=lambda r: r.rank)
            return text("interrupted", first.detail), first.code, None
    own = [r for r in reports if not r.secondary and r.kind != "interrupted"]
    if own:
        first = min(own, key=lambda r: (r.time, r.rank))
        return text(first.kind, first.detail, first.rank), first.code, first.traceback
    reported = {r.rank for r in reports}
    failures = (agent or {}).get("failures", [])
    silent = [f for f in failures if f["rank"] not in reported and f["exitcode"] < 0]
    if silent:
        first = next((f for f in silent if f["rank"] == (agent or {}).get("first")), silent[0])
        name = _signal_name(-first["exitcode"])
        return text("failure", f"killed by {name}", first["rank"]), 1, None
    rest = [r for r in reports if r.kind != "interrupted"] or list(reports)
    if rest:
        first = min(rest, key=lambda r: (r.time, r.rank))
        if first.kind == "interrupted" and signaled is None:
            return text("failure", "stopped by torchrun after another rank failed", first.rank), 1, None
        return text(first.kind, first.detail, first.rank), first.code, first.traceback
    if signaled is not None:
        return text("interrupted", "interrupted; no rank reported its step"), 128 + signaled, None
    if failures:
        first = next((f for f in failures if f["rank"] == (agent or {}).get("first")), failures[0])
        return text("failure", f"exited with status {first['exitcode']}", first["rank"]), 1, None
    return text("failure", f"torchrun exited with status {returncode} (FSDPX_VERBOSE=1 shows its output)"), 1, None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
