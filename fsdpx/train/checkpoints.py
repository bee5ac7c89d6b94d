"""A run's checkpoints: the manager that saves the train state in the run's own layout, and the
state as a checkpoint holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ckpt
import offload
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import local_box
from fsdpx.sharding.plan import ShardingPlan
from offload.checkpoint_form import Shapes, from_checkpoint, is_checkpoint_form, to_checkpoint
from offload.zero_offload import per_parameter_counts

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


def savable(state: Any, manager: ckpt.CheckpointManager | None = None) -> Any:
    """``state`` as a checkpoint holds it: a ZenFlow state with any in-flight host window
    finished, in its checkpoint form (``offload.checkpoint_form``: every tensor this rank's
    block of a weight-shaped or per-column one, in ``manager``'s layout, so a tensor- or
    pipeline-parallel run's per-rank selections are one global selection per weight), and an
    offloading optimizer's last-step ``metrics`` (seconds and bytes each rank measured for its
    own loop and shard, so they differ between ranks) zeroed: plain data, the same on every
    rank; training continues bit for bit from it after :func:`restored` (the metrics are
    reported, never read by the update:
    ``tests/test_train_resume.py::test_sharded_zero3_run_resumes_bit_for_bit``,
    ``tests/test_offload_model_parallel.py::test_zenflow_with_model_parallelism_resumes_bit_for_bit``)."""
    opt = state.opt_state
    if not isinstance(opt, dict):
        return state
    if "selected" in opt:
        opt = to_checkpoint(opt, _blocks(manager))
    elif "master" in opt and "inner" in opt:  # ZeRO-Offload: the same kind of count on every stage
        opt = per_parameter_counts(opt)
    if isinstance(opt.get("metrics"), dict):
        opt = {**opt, "metrics": {k: type(v)() for k, v in opt["metrics"].items()}}
    return state._replace(opt_state=opt)


def restored(state: Any, fresh: Any) -> Any:
    """A loaded ``state`` ready to train: a ZenFlow optimizer state in its checkpoint form
    (:func:`savable`) turned back into this rank's runtime state, shaped and placed as in
    ``fresh`` (the segment's ``init`` state); per-parameter step counts cut to the parameters
    this rank holds (:func:`_held_counts`); anything else as it is. Raises ``KeyError``
    naming a weight the checkpoint holds no ZenFlow state for."""
    opt = getattr(state, "opt_state", None)
    if not isinstance(opt, dict):
        return state
    if is_checkpoint_form(opt):
        return state._replace(opt_state=from_checkpoint(opt, fresh.opt_state))
    names = set(getattr(state, "params", None) or {})
    return state._replace(opt_state=_held_counts(opt, names)) if names else state


def _held_counts(opt: dict, names: set[str]) -> dict:
    """``opt`` with every per-parameter ``count`` (``{name: int}``, an optimizer under a
    freezing schedule, or ZeRO-Offload's ``inner``) cut to the parameters this rank holds: a
    pipeline checkpoint's tree lists every stage's counts, and a count this rank never updates
    would differ from its stage's at the next save."""
    out = dict(opt)
    if isinstance(out.get("count"), dict):
        out["count"] = {k: v for k, v in out["count"].items() if k in names}
    if isinstance(out.get("inner"), dict):
        out["inner"] = _held_counts(out["inner"], names)
    return out


def _blocks(manager: ckpt.CheckpointManager | None) -> Shapes:
    """Each weight's block shape and where its columns start on this rank, from the manager's
    plan (a view of a fused weight included); ``{}`` without one (every weight a plain matrix)."""
    plan = None if manager is None else manager.strategy
    if not isinstance(plan, ShardingPlan):
        return {}
    out = {}
    for name, (spec, shape, b) in offload.weight_layouts(plan).items():
        box = local_box(shape, spec, manager.mesh, manager.coordinator.rank)
        out[name] = (tuple(e - s for s, e in box), b)
    return out


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
