"""torchrun, quiet: the agent process of ``fsdpx train --nproc`` (:func:`fsdpx.train.launch.launch`).

    python -m fsdpx.train.agent --standalone --nproc-per-node=2 -m fsdpx train ...   # torchrun's arguments

Runs torchrun's own ``run`` in this process, with two differences the user sees: torchrun's log
lines (rendezvous, "Received SIGTERM death signal", "Sending process ... closing signal") and its
``ChildFailedError`` banner and traceback are not printed unless ``FSDPX_VERBOSE`` is set
(``--verbose``); and the failed workers of its last attempt, as torchrun saw them (rank, exit
code, the signal that killed one), are written to ``agent.json`` in ``FSDPX_REPORT_DIR`` for the
launcher, which says what happened in one line (:func:`fsdpx.train.reports.choose`).

Exit status: 0 when every worker succeeded, 1 when one failed (torchrun's), 128 + N when this
agent got signal N (torchrun has then passed it on to every worker and waited for them, up to
``--shutdown-timeout`` seconds, before killing them).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from .reports import AGENT, REPORT_DIR, verbose


def quiet_torchrun() -> None:
    """No log record of this process is printed: it runs torchrun only (its loggers carry their
    own levels and handlers, so silencing one parent logger would not do)."""
    logging.disable(logging.CRITICAL)


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; returns the exit status (see the module doc)."""
    loud = verbose()
    if not loud:
        quiet_torchrun()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        _record(err)
        if loud:
            print(err.format_msg(), file=sys.stderr)
        return 1
    except SignalException as err:
        if loud:
            print(f"torchrun: {err}", file=sys.stderr)
        return 128 + int(err.sigval)
    return 0


def _record(err) -> None:
    where = os.environ.get(REPORT_DIR)
    if where is None:
        return
    first, _ = err.get_first_failure()
    failures = [{"rank": int(rank), "exitcode": int(f.exitcode), "signal": f.signal_name()}
                for rank, f in sorted(err.failures.items())]
    tmp = Path(where) / f"{AGENT}.tmp"
    tmp.write_text(json.dumps({"first": int(first), "failures": failures}))
    os.replace(tmp, Path(where) / AGENT)


if __name__ == "__main__":
    import atexit
    import gc

    atexit.register(gc.freeze)  # at exit, no last collection over torch's objects (as fsdpx.__main__)
    sys.exit(main(sys.argv[1:]))
