"""The ``fsdpx`` command (also ``python -m fsdpx``): the front door above the training job and the
jobs planner, dispatching each command to its own command line.

    fsdpx train ...                      # one run (fsdpx.train.cli; fsdpx train --help)
    fsdpx jobs plan examples/jobs.toml   # many jobs at once (fsdpx.jobs.cli)
    fsdpx schedule 1f1b --ranks 4 --microbatches 8   # a pipeline schedule simulated (fsdpx.train.schedule_cli)
    fsdpx export runs/ft/ckpt --to my-model          # a checkpoint's model for transformers (fsdpx.train.export_cli)
    fsdpx audit --noise-multiplier 4 --steps 4       # one-run privacy audit of the private step (fsdpx.train.audit_cli)
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    """Run the command ``argv`` names (default ``sys.argv[1:]``); anything that is not ``jobs``,
    ``schedule``, ``export`` or ``audit`` goes to ``fsdpx train``'s parser, which also answers ``--help`` and a missing or
    unknown command (exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    importable_from_here()
    if argv[:1] == ["jobs"]:  # the multi-job planner has its own command line
        from fsdpx.jobs.cli import main as jobs_main

        return jobs_main(argv[1:])
    if argv[:1] == ["schedule"]:  # a pipeline schedule simulated and shown
        from fsdpx.train.schedule_cli import main as schedule_main

        return schedule_main(argv[1:])
    if argv[:1] == ["export"]:  # a checkpoint's model as a directory transformers loads
        from fsdpx.train.export_cli import main as export_main

        return export_main(argv[1:])
    if argv[:1] == ["audit"]:  # the private step's privacy measured from one run of canaries
        from fsdpx.train.audit_cli import main as audit_main

        return audit_main(argv[1:])
    from fsdpx.train.cli import main as train_main

    return train_main(argv)


def importable_from_here() -> None:
    """Put the directory ``fsdpx`` runs in first on ``sys.path``, as ``python -m fsdpx`` does, so
    ``--model-fn mylab.jobs:model`` finds ``mylab/`` beside the user the same way from the
    ``fsdpx`` script (whose own path is its bin directory) and from ``python -m``; torchrun's
    workers (``-m fsdpx``, same directory) find it too. Nothing when it is there already
    (``tests/test_cli.py::test_your_own_package_imports_from_the_directory_you_run_in``)."""
    here = os.getcwd()
    if not any(p in ("", here) for p in sys.path):
        sys.path.insert(0, here)


if __name__ == "__main__":
    main()
