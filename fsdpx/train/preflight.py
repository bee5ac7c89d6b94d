"""Refuse before writing: the checks on the directories a run writes, made before any process
starts or any file is touched, so that nothing a user types wrong costs them work.

    check_before_writing(config)     # raises a RefusedError (a ConfigError) naming the flag, or returns

``fsdpx train`` calls it in the launcher, before torchrun starts (a sharded run refuses exactly
like a one-process run: one line, exit 2), and :func:`fsdpx.train.run` calls it again on its
main rank before anything else, so the Python entry refuses the same way. What is refused:

* ``--ckpt-dir`` or the run directory (``--out``/``--name``) is a file, or cannot be written
  (:class:`DirectoryUnusableError`);
* a new run (no ``--resume``, or a branch ``--resume-from``) into a checkpoint directory that
  already holds ``step_<N>`` entries: its checkpoints would mix with another run's and a later
  ``--resume`` could continue the wrong one (:class:`CheckpointDirInUseError`);
* ``--resume`` when the checkpoint directory holds no checkpoint: a typo must not silently
  restart training (:class:`NothingToResumeError`). ``--resume-if-present`` is the explicit
  mode for elastic restarts and schedulers: it resumes when there is a checkpoint and starts
  the run otherwise;
* a run directory that holds files (:class:`RunDirExistsError`), unless ``--overwrite`` (its
  run files are replaced), or the run continues into it: ``--resume`` into the directory its
  checkpoint root's ``run.json`` records (or any, for a root without one), and
  ``--resume-if-present`` into whatever it names (the run's own, re-started by a scheduler).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpt.format import MANIFEST
from ckpt.manager import committed_steps

from .config import RunConfig
from .errors import ConfigError
from .segments import CheckpointNotFoundError, read_record


class RefusedError(ConfigError):
    """A run refused before writing anything; the message names the flag and what to do."""


class DirectoryUnusableError(RefusedError):
    """A directory the run writes is a file, or cannot be written or read."""


class CheckpointDirInUseError(RefusedError):
    """A new run's ``--ckpt-dir`` already holds another run's ``step_<N>`` entries."""


class RunDirExistsError(RefusedError):
    """The run directory holds files that the run would replace (``--overwrite`` to allow it)."""


class NothingToResumeError(RefusedError, CheckpointNotFoundError):
    """``--resume`` found no checkpoint in ``--ckpt-dir``."""


def check_before_writing(config: RunConfig) -> None:
    """Return when ``config`` may write its run directory and checkpoint directory; raise the
    named :class:`RefusedError` otherwise (the checks are in the module doc). Reads, never
    writes; cheap (a few ``stat`` calls and a directory listing; no checkpoint is read).

    Edge cases: a directory that does not exist yet is checked where it would be created (its
    nearest existing ancestor must be a writable directory); an empty run directory is not a
    run; a root holding only ``run.json`` (a run stopped before its first checkpoint) holds
    nothing to resume or mix with. ``--resume`` finds a checkpoint here when a ``step_<N>``
    holds a manifest; one that does not verify is refused later, by
    :func:`fsdpx.train.resume.find_source`, still before anything is written.
    Proven by ``tests/test_newcomer_refusals.py`` (the real CLI, one process and sharded: exit
    2, one line, the directories' bytes and times unchanged)."""
    c = config.checkpoints
    if c.ckpt_dir is not None:
        check_directory(Path(c.ckpt_dir), f"--ckpt-dir {c.ckpt_dir}")
        _check_checkpoints(config)
    check_directory(Path(config.logging.out), f"--out {config.logging.out}")
    check_directory(config.run_dir, f"--name {config.logging.name}: {config.run_dir}")
    _check_run_dir(config)


def check_directory(path: Path, label: str) -> None:
    """Raise :class:`DirectoryUnusableError` (message starting with ``label``) unless ``path`` is a
    directory this process can list and write, or can be created: its nearest existing ancestor
    is a writable directory (``tests/test_newcomer_refusals.py::test_an_unusable_directory_is_refused``)."""
    probe = path
    while not (probe.exists() or probe.is_symlink()) and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        subject = label if probe == path else f"{label}: {probe}"
        raise DirectoryUnusableError(f"{subject} is a file, not a directory" if probe.is_file() else
                                     f"{subject} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        cannot = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise DirectoryUnusableError(f"{label} {cannot} (permission denied)")
    if probe == path and not os.access(path, os.R_OK):
        raise DirectoryUnusableError(f"{label} is not readable (permission denied)")


def _check_checkpoints(config: RunConfig) -> None:
    """What the checkpoint directory holds against how the run starts (see the module doc)."""
    c = config.checkpoints
    root = Path(c.ckpt_dir)
    steps = committed_steps(root)
    if c.resume:
        if not any((root / f"step_{s}" / MANIFEST).is_file() for s in steps):
            why = "is empty" if root.is_dir() and not steps else ("holds no checkpoint" if root.is_dir() else
                                                                  "does not exist")
            raise NothingToResumeError(
                f"--resume: --ckpt-dir {c.ckpt_dir} {why}, so there is nothing to resume; check the path, or"
                " start a new run without --resume (--resume-if-present resumes when there is a checkpoint and"
                " starts otherwise)")
    elif not c.resume_if_present and steps:
        held = ", ".join(f"step_{s}" for s in steps[:6]) + (", ..." if len(steps) > 6 else "")
        raise CheckpointDirInUseError(
            f"--ckpt-dir {c.ckpt_dir} already holds {held}: a new run there would mix its checkpoints with"
            " another run's; continue that run with --resume, or give another --ckpt-dir")


def _check_run_dir(config: RunConfig) -> None:
    """An existing, non-empty run directory against ``overwrite`` and how the run starts."""
    run_dir, c = config.run_dir, config.checkpoints
    held = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if not held or config.logging.overwrite or c.resume_if_present:
        return
    recorded = _recorded_run_dir(c.ckpt_dir) if c.resume else None
    if c.resume and (recorded is None or recorded.resolve() == run_dir.resolve()):
        return
    listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    name = f"--name {config.logging.name}: {run_dir}"
    if c.resume:
        raise RunDirExistsError(f"{name} holds another run ({listed}), not the one --ckpt-dir {c.ckpt_dir}"
                                f" continues ({recorded}); pass --overwrite to replace it, or give another --name")
    raise RunDirExistsError(f"{name} already holds a run ({listed}); pass --overwrite to replace it, --resume"
                            " to continue it, or give another --name")


def _recorded_run_dir(root: str | None) -> Path | None:
    """The run directory a checkpoint root's ``run.json`` names, or ``None`` without a readable one."""
    try:
        record = read_record(root) if root is not None else None
    except (OSError, ValueError):
        return None
    return Path(record["run_dir"]) if isinstance(record, dict) and record.get("run_dir") else None
