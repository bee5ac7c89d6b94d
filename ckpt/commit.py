"""The atomic commit of a checkpoint directory, and its atomic removal. All filesystem
side effects of ``ckpt`` that are not the shard bytes themselves live here.

Protocol (POSIX rename semantics)::

    prepare:  <parent>/.<name>.tmp-<token>/          fresh, empty (the final name must not exist)
    writers:  tmp/rank_<r>.safetensors               each written, then fsynced, by its rank
    commit:   tmp/manifest.json                      written, fsynced (only after every rank
                                                     reported its file durable)
              fsync(tmp)                             the directory entries are durable
              rename(tmp, <parent>/<name>)           atomic: the checkpoint appears whole
              fsync(parent)                          the rename is durable

A crash at any point leaves either no ``<name>`` or a complete one; leftovers are dot-named
``.tmp-``/``.deleting-`` directories that ``latest()`` ignores and ``stale_temporaries`` lists
for the manager to remove. Removal renames to ``.<name>.deleting-<token>`` first, so a
checkpoint never exists half-deleted under its real name.

Guarantees: ``tests/test_ckpt_commit.py::test_commit_order_is_fsync_files_manifest_dir_rename_parent``
records the system calls and checks this order; ``commit`` never replaces an existing
directory (``CheckpointExistsError``) (``test_commit_never_replaces_an_existing_checkpoint``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
from pathlib import Path

from .errors import CheckpointExistsError
from .format import MANIFEST

_LEFTOVER = re.compile(r"^\..+\.(tmp|deleting)-[0-9a-f]+$")
_PUBLISHING = threading.Lock()  # held while a commit publishes; held for good by hold_commits()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(directory: Path) -> Path:
    """Create and return a fresh temporary sibling of ``directory`` (which must not exist)."""
    directory = Path(directory)
    if directory.exists():
        raise CheckpointExistsError(str(directory))
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    return tmp


def write_durably(path: Path, data: bytes) -> None:
    """Create ``path`` (must not exist), write ``data``, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, directory: Path, manifest: bytes) -> Path:
    """Write the manifest into ``tmp`` and publish ``tmp`` as ``directory``, durably. Call
    only when every shard file in ``tmp`` is already fsynced."""
    directory = Path(directory)
    write_durably(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    with _PUBLISHING:
        if directory.exists():  # os.rename would silently replace an EMPTY directory
            raise CheckpointExistsError(str(directory))
        os.rename(tmp, directory)
        fsync_dir(directory.parent)
    return directory


def hold_commits(timeout_s: float = 5.0) -> bool:
    """Publish no more checkpoints in this process, for good: returns ``True`` once a commit
    under way has published (its rename and fsync done), and a later :func:`commit` blocks;
    ``False`` if that commit did not finish within ``timeout_s`` (a hung filesystem: the caller
    is not held up longer, and the commit may still publish). For a process
    about to exit (the grace-period watchdog of :mod:`fsdpx.train.interrupts`), so that the
    newest checkpoint it names is the newest there will be: an async save committing between
    that reading and the exit would otherwise leave a newer one than the run said
    (``tests/test_ckpt_commit.py::test_no_commit_publishes_after_hold_commits``)."""
    return _PUBLISHING.acquire(timeout=timeout_s)


def abort(tmp: Path | None) -> None:
    """Discard a temporary directory (best effort: a leftover is harmless)."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def set_aside(directory: Path, label: str) -> Path:
    """Atomically move ``directory`` to a dot-named sibling ``.<name>.<label>-<token>``."""
    directory = Path(directory)
    aside = directory.parent / f".{directory.name}.{label}-{secrets.token_hex(6)}"
    os.rename(directory, aside)
    fsync_dir(directory.parent)
    return aside


def remove(directory: Path) -> None:
    """Delete a checkpoint: first renamed away (atomic), then its files."""
    shutil.rmtree(set_aside(directory, "deleting"), ignore_errors=True)


def stale_temporaries(root: Path) -> list[Path]:
    """Leftovers of interrupted saves and removals directly under ``root``."""
    if not Path(root).is_dir():
        return []
    return sorted(p for p in Path(root).iterdir() if _LEFTOVER.match(p.name) and p.is_dir())
