"""``CheckpointManager``: periodic saves under one root, retention, and resuming the newest
intact checkpoint.

    manager = CheckpointManager("runs/a/ckpt", mesh=mesh, strategy=zero3(), keep_last=3,
                                every_n_steps=100, private=True, coordinator=coord)
    state = manager.restore() or fresh_state()          # newest intact checkpoint, or None
    for step in ...:
        state = train_step(state)
        manager.save(step, state, blocking=False)       # no-op unless step % every_n_steps == 0
    manager.wait()

Layout of ``root``: committed checkpoints ``step_<N>/``; anything dot-named is a leftover of an
interrupted save or removal (``ckpt.commit``), ignored by ``latest`` and removed by rank 0 at
the start of the next save (one training job per root).

Guarantees (``tests/test_ckpt_manager.py`` unless named):
  * ``latest()`` returns the newest ``step_<N>`` that passes ``ckpt.verify``; a corrupt one is
    skipped with a ``CorruptCheckpointWarning`` naming the error
    (``tests/test_ckpt_corruption.py::test_latest_skips_a_corrupt_checkpoint_with_a_warning``).
  * Retention runs after a commit, on rank 0: it keeps the just-committed checkpoint and the
    ``keep_last - 1`` newest older ones; so the newest complete checkpoint is never deleted,
    and a checkpoint is deleted only once ``keep_last`` newer-or-equal ones are committed
    (``test_retention_keeps_last_n_and_never_the_newest``). Newer steps (from an abandoned
    branch of the run) are left alone.
  * Retention deletes only what it can prove this run wrote: a ``step_<N>`` whose manifest
    reads and records the manager's ``run_id``. Another run's checkpoints, a checkpoint of an
    older format without a run id, and a user's own ``step_1/`` folder are never deleted, nor
    counted among the ``keep_last`` (``test_retention_deletes_only_its_own_run_s_checkpoints``).
    ``run_id`` defaults to a fresh one per manager; a run continued by a new process passes its
    own (``fsdpx train`` keeps it in the root's ``run.json``).
  * SIGKILL at any point of a save leaves ``latest()`` valid, never older than before
    (``tests/test_ckpt_kill.py::test_sigkill_at_100_random_points_never_loses_a_checkpoint``).
  * Saving a step that exists: ``CheckpointExistsError`` if it verifies; if it is corrupt it is
    set aside as ``.step_<N>.corrupt-<token>`` (kept for inspection) and the save proceeds
    (``test_a_corrupt_checkpoint_at_the_same_step_is_set_aside``).
  * A failed background save is never dropped unseen: the next ``save`` waits for it and
    re-raises its error before starting (nothing of the new step is written), else ``wait``
    does; each error is raised once
    (``test_a_failed_async_save_surfaces_at_the_next_save``).
"""

from __future__ import annotations

import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from fsdpx.sharding import Mesh

from . import commit
from .async_save import SaveHandle, saver_for
from .coordinator import Coordinator, SingleProcess
from .errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, SaveError
from .loading import load, read_manifest
from .rules import Layouts, Specs
from .saving import save
from .verify import verify

_STEP = re.compile(r"^step_(\d+)$")


class CorruptCheckpointWarning(UserWarning):
    """``latest()`` skipped a checkpoint that failed verification."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def step_of(path: Path | str) -> int | None:
    """The step ``N`` of a checkpoint directory named ``step_<N>`` (only the last path component
    counts); ``None`` for any other name, e.g. ``step_x``, ``step_-1`` or ``steps_3``. The inverse
    of :func:`step_dir` (``tests/test_ckpt_manager.py::test_step_of_inverts_step_dir``)."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def committed_steps(root: Path) -> list[int]:
    """Steps of the ``step_<N>`` directories under ``root``, ascending (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(s for p in root.iterdir() if (s := step_of(p)) is not None and p.is_dir())


def new_run_id() -> str:
    """A fresh run id: 16 random hex digits (two runs never share one by chance)."""
    return secrets.token_hex(8)


def to_delete(steps: Sequence[int], just_saved: int, keep_last: int) -> list[int]:
    """Retention, pure: the steps older than ``just_saved`` beyond the ``keep_last - 1`` newest."""
    older = sorted((s for s in steps if s < just_saved), reverse=True)
    return sorted(older[max(keep_last - 1, 0):])


class CheckpointManager:
    def __init__(self, root: str | Path, *, mesh: Mesh | None = None, strategy: Layouts = None,
                 coordinator: Coordinator | None = None, keep_last: int = 3, every_n_steps: int = 1,
                 specs: Specs = None, private: bool = False, run_id: str | None = None) -> None:
        if keep_last < 1 or every_n_steps < 1:
            raise ValueError(f"keep_last and every_n_steps must be >= 1, got {keep_last}, {every_n_steps}")
        self.root = Path(root)
        self.mesh = mesh if mesh is not None else Mesh()
        self.strategy, self.specs, self.private = strategy, specs, private
        self.coordinator = coordinator if coordinator is not None else SingleProcess()
        self.keep_last, self.every_n_steps = keep_last, every_n_steps
        self.run_id = run_id if run_id is not None else new_run_id()  # recorded in each manifest; see _retain
        self._last: SaveHandle | None = None
        self._last_dir: Path | None = None

    # ---- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def save(self, step: int, state: Any, *, force: bool = False, blocking: bool = True) -> SaveHandle | None:
        """Save ``state`` as ``step_<step>`` if due (or ``force``); ``None`` if not due.

        The previous save is waited for first and its error, if it failed, is raised here
        (``SaveError`` naming its ``step_<N>``), before anything of this step is written: a
        run learns of a failed background save at its next save at the latest."""
        if not (force or self.should_save(step)):
            return None
        self.wait()  # our previous save: finished and succeeded, else its error stops this one
        saver_for(self.coordinator).wait_idle()  # any save of this rank owns its temporary directory
        if self.coordinator.rank == 0:
            self._prepare_root(step)
        self._last_dir = step_dir(self.root, step)
        self._last = save(self._last_dir, state, mesh=self.mesh, strategy=self.strategy,
                          coordinator=self.coordinator, specs=self.specs, private=self.private, step=step,
                          blocking=blocking, on_commit=self._retain, run_id=self.run_id)
        return self._last

    def wait(self) -> Path | None:
        """Wait for the last save; its committed path, or re-raise its error (a ``SaveError``
        naming its ``step_<N>``). Each save is answered once: ``None`` when no save is pending
        (none started, or already waited for)."""
        last, self._last = self._last, None
        if last is None:
            return None
        try:
            return last.wait()
        except OSError as e:  # rank 0 could not even start it (e.g. a full disk): name the checkpoint too
            raise SaveError(f"checkpoint {self._last_dir} not saved: {type(e).__name__}: {e}") from e

    def _prepare_root(self, step: int) -> None:
        for leftover in commit.stale_temporaries(self.root):
            shutil.rmtree(leftover, ignore_errors=True)
        target = step_dir(self.root, step)
        if target.exists():
            try:
                verify(target)
            except CorruptCheckpointError as e:
                aside = commit.set_aside(target, "corrupt")
                warnings.warn(f"{target} was corrupt ({e}); moved to {aside.name}", CorruptCheckpointWarning, stacklevel=3)
            else:
                raise CheckpointExistsError(str(target))

    def _retain(self, saved: Path) -> None:
        just_saved = step_of(saved)
        steps = [s for s in committed_steps(self.root) if self.wrote(step_dir(self.root, s))]
        if any(s > just_saved for s in steps):
            warnings.warn(f"{self.root} holds checkpoints newer than step {just_saved}; retention leaves them",
                          RuntimeWarning, stacklevel=2)
        for s in to_delete(steps, just_saved, self.keep_last):
            commit.remove(step_dir(self.root, s))

    def wrote(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this manager's run: its manifest reads and records
        ``run_id``. False for anything else (no or unreadable manifest, another or no run id):
        retention deletes only what this returns True for."""
        try:
            return read_manifest(path).run_id == self.run_id
        except (CheckpointError, OSError):
            return False

    # ---- resuming ----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return committed_steps(self.root)

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (whole-file checksums), or ``None``."""
        for s in reversed(committed_steps(self.root)):
            path = step_dir(self.root, s)
            try:
                verify(path)
            except CorruptCheckpointError as e:
                warnings.warn(f"skipping corrupt checkpoint {path}: {type(e).__name__}: {e}",
                              CorruptCheckpointWarning, stacklevel=2)
                continue
            except FileNotFoundError:  # removed while we looked (retention of a running job)
                continue
            return path
        return None

    def restore(self, *, mesh: Mesh | None = None, strategy: Layouts | str = "same",
                expected_shapes: Mapping[str, Sequence[int]] | None = None, specs: Specs | str = "same") -> Any:
        """Rank's local state from the newest intact checkpoint (rank 0 chooses it, verifying
        it once, and tells the others), in ``mesh``/``strategy`` (default: the manager's).
        ``None`` when there is none."""
        c = self.coordinator
        chosen = self.latest() if c.rank == 0 else None
        chosen = c.broadcast(None if chosen is None else str(chosen)) if c.world > 1 else chosen
        if chosen is None:
            return None
        return load(chosen, mesh=mesh if mesh is not None else self.mesh,
                    strategy=self.strategy if strategy == "same" else strategy,
                    specs=self.specs if specs == "same" else specs,
                    rank=c.rank, expected_shapes=expected_shapes, private=self.private)
