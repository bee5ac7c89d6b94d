"""A run's checkpoints: the manager that saves the train state in the run's own layout, and the
state as a checkpoint holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ckpt
import offload
from fsdpx.sharding.comm import Comm

from .config import RunConfig
from .errors import RunFailure
from .parallel import Parallel


def checkpoint_manager(config: RunConfig, comm: Comm | None, *, private: bool,
                       parallel: Parallel | None = None) -> ckpt.CheckpointManager | None:
    """The run's :class:`ckpt.CheckpointManager` (``None`` without ``ckpt_dir``): the sharded
    state is saved by every rank in the layouts of ``parallel`` (the run's, resolved once) and
    can be restored into another."""
    c = config.checkpoints
    if c.ckpt_dir is None:
        return None
    if comm is None:
        return ckpt.CheckpointManager(c.ckpt_dir, keep_last=3, every_n_steps=c.ckpt_every, private=private)
    return ckpt.CheckpointManager(c.ckpt_dir, mesh=comm.mesh, strategy=parallel.plan,
                                  coordinator=ckpt.TorchDistCoordinator(), keep_last=3,
                                  every_n_steps=c.ckpt_every, private=private)


def savable(state: Any) -> Any:
    """``state`` with any in-flight ZenFlow host window finished and folded in, and an
    offloading optimizer's last-step ``metrics`` (seconds and bytes each rank measured for its
    own loop and shard, so they differ between ranks) zeroed: plain data, the same on every
    rank, that a checkpoint can hold; training continues bit for bit from it (the metrics are
    reported, never read by the update:
    ``tests/test_train_resume.py::test_sharded_zero3_run_resumes_bit_for_bit``)."""
    opt = state.opt_state
    if not isinstance(opt, dict):
        return state
    if "selected" in opt:
        opt = offload.materialize(opt)
    if isinstance(opt.get("metrics"), dict):
        opt = {**opt, "metrics": {k: type(v)() for k, v in opt["metrics"].items()}}
    return state._replace(opt_state=opt)


def newest_checkpoint(manager: ckpt.CheckpointManager | None) -> Path | None:
    """The newest committed checkpoint of ``manager``'s run under its root (``step_<N>`` whose
    manifest records the run's id; commits are atomic, so it is whole; its checksums are not
    read: cheap enough for a run that must stop within a grace period), or ``None`` (no
    manager, none yet)."""
    if manager is None:
        return None
    for step in reversed(manager.steps()):
        path = manager.root / f"step_{step}"
        if manager.wrote(path):
            return path
    return None


def save_failure(err: BaseException, step: int, manager: ckpt.CheckpointManager) -> RunFailure:
    """The one-line :class:`RunFailure` of a checkpoint that could not be saved (``err``, its
    ``SaveError`` naming ``step_<N>`` and the cause, or the error of a save that could not start),
    the run stopping at ``step``, with the newest intact checkpoint to continue from
    (``tests/test_fault_injection.py::test_a_run_survives_faults_at_random_steps_and_ends_as_an_uninterrupted_run``:
    a tmpfs that fills up)."""
    cause = str(err) if isinstance(err, ckpt.SaveError) else \
        f"checkpoint not saved in {manager.root}: {type(err).__name__}: {err}"
    newest = newest_checkpoint(manager)
    where = f"newest checkpoint {newest} (continue with --resume)" if newest else \
        f"newest checkpoint: none in {manager.root}"
    return RunFailure(f"{cause.splitlines()[0]}; stopped at step {step}; {where}")
