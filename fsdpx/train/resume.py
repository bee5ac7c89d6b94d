"""Starting a segment of a run: from scratch, from the newest checkpoint (``resume``) or from any
intact checkpoint (``resume_from``, a branch), with the privacy budget kept across segments.

    state, dp = resume_from("runs/a/ckpt/step_10", {"lr": 3e-3, "steps": 40})   # from Python

:func:`plan_segment` is the one place a segment is planned; ``fsdpx train`` (through
:func:`fsdpx.train.run`) and :func:`resume_from` both call it, so research code gets the CLI's
guarantees. It reads the checkpoint, its manifest and its root's ``run.json``
(:mod:`fsdpx.train.segments`), and writes nothing: every refusal (a change a resume cannot
honour, a budget that does not fit, a larger budget without ``allow_budget_increase``) is raised
before the run directory or a checkpoint is touched.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import ckpt
from ckpt.format import MANIFEST
from ckpt.manager import new_run_id, step_of
from privacy.mechanisms import INDEPENDENT, Mechanism
from privacy.step import DPConfig

from .budget import check_budget_change, segment_noise
from .build import build_step, resolve_privacy, resolve_sample_rate
from .checkpoints import checkpoint_manager, restored
from .config import RunConfig
from .preflight import NothingToResumeError
from .report import json_safe
from .segments import (PENDING_DIGEST, CheckpointNotFoundError, ResumeError, check_compatible, data_digest, fingerprint, lineage,
                       owner, read_record)
from .sources import build_source


class SegmentPlan(NamedTuple):
    """What a segment starts from. ``state``: restored (its accountant carrying this segment's
    budget, delta and accountant kind) or fresh; ``dp``: the privacy of its steps (``None`` for
    a non-private run); ``start``: the step it starts at; ``source``: the checkpoint, if any;
    ``segments``: the lineage of ``state`` plus this segment's entry; ``earlier_run_dir``: the
    run directory holding the metrics of steps ``1..start``; ``notes``: lines for the user;
    ``run_id``: the run's id (:func:`run_id`), recorded in its checkpoints and ``run.json``."""

    state: Any
    dp: DPConfig | None
    start: int
    source: Path | None
    segments: list[dict[str, Any]]
    earlier_run_dir: Path | None
    notes: list[str]
    run_id: str | None = None


def find_source(config: RunConfig, manager: Any) -> Path | None:
    """The checkpoint a segment starts from: ``resume_from`` (a ``step_<N>`` directory,
    verified, or a checkpoint root: its newest intact checkpoint), else with ``resume``
    the newest intact checkpoint of ``manager`` (chosen by rank 0), with ``resume_if_present``
    that or ``None``, else ``None``. Raises :class:`CheckpointNotFoundError` when
    ``resume_from`` names no intact checkpoint, and its
    :class:`fsdpx.train.preflight.NothingToResumeError` when ``resume`` finds none (a root whose
    checkpoints all fail verification: the preflight saw their manifests only)."""
    c = config.checkpoints
    if c.resume_from is not None:
        return find_checkpoint(c.resume_from)
    if not (c.resume or c.resume_if_present) or manager is None:
        return None
    coordinator = manager.coordinator
    chosen = manager.latest() if coordinator.rank == 0 else None
    chosen = coordinator.broadcast(None if chosen is None else str(chosen)) if coordinator.world > 1 else chosen
    if chosen is None and c.resume:
        raise NothingToResumeError(f"--resume: --ckpt-dir {c.ckpt_dir} holds no intact checkpoint, so there is"
                                   " nothing to resume")
    return None if chosen is None else Path(chosen)


def run_id(config: RunConfig, source: Path | None, record: Mapping[str, Any] | None, manager: Any) -> str | None:
    """The id of the run a segment belongs to: a resume (``resume``, ``resume_if_present``) from a
    checkpoint continues its run's (the root's ``run.json``, else the checkpoint's manifest);
    anything else (a new run, a branch) is a new run with a new id. ``None`` without a
    checkpoint directory. Rank 0's choice, broadcast, so every rank agrees."""
    if manager is None:
        return None
    c = config.checkpoints
    found = None
    if source is not None and (c.resume or c.resume_if_present):
        found = (record or {}).get("run_id") or ckpt.read_manifest(source).run_id
    chosen = found or new_run_id()
    coordinator = manager.coordinator
    return coordinator.broadcast(chosen) if coordinator.world > 1 else chosen


def plan_segment(config: RunConfig, *, params: Mapping[str, Any], fresh: Any, dp: DPConfig | None,
                 digest: str | Callable[[], str], manager: Any, world: int = 1, data: str | None = None) -> SegmentPlan:
    """Plan the segment ``config`` asks for (see the module doc); reads, never writes.

    Guarantees:
      * A private segment's steps get the noise :func:`fsdpx.train.budget.segment_noise` plans
        against the checkpoint's exact history, so the whole run ends at or below its target
        (``tests/test_budget.py``, ``property_tests/test_budget_properties.py``); a fixed
        ``noise_multiplier`` is kept (the budget, if any, stops the run).
      * A change a resume cannot honour raises the named ``fsdpx.train.segments.ResumeError``
        before the checkpoint is loaded (``tests/test_train_segments.py``).
      * Same config and checkpoint, same plan: the state and noise are functions of them
        (``test_a_branch_run_twice_from_one_checkpoint_gives_the_same_bits``).

    ``digest`` is :func:`fsdpx.train.segments.data_digest` of the examples, or a function giving
    it (a mapped file's, hashed in the background: called only when there is a checkpoint to
    compare with; a fresh segment's fingerprint then holds :data:`PENDING_DIGEST`, for the caller
    to fill in before its first checkpoint), and ``data`` their description
    (:attr:`fsdpx.train.sources.Source.description`), named when data changes."""
    source = find_source(config, manager)
    if source is None:
        new_fp = fingerprint(config, params, digest if isinstance(digest, str) else PENDING_DIGEST, data=data)
        planned = _plan_noise(config, dp, fresh.accountant, current=dp.noise_multiplier if dp else None)
        entry = _entry(config, 0, None, planned, new_fp, world)
        return SegmentPlan(fresh, planned, 0, None, [entry], None, [], run_id(config, None, None, manager))

    digest = digest if isinstance(digest, str) else digest()
    new_fp = fingerprint(config, params, digest, data=data)
    manifest = ckpt.read_manifest(source)
    step = manifest.step if manifest.step is not None else int(source.name.split("_")[-1])
    record = read_record(source.parent)
    segment_run = run_id(config, source, record, manager)
    segments = record["segments"] if record else []
    wrote = owner(segments, step)
    shapes = {k: (t.param_shape or t.shape) for k, t in manifest.tensors.items()}
    recorded = wrote["fingerprint"] if wrote else None
    if recorded is not None and _same_legacy_data(recorded["data"], digest):
        recorded = {**recorded, "data": new_fp["data"]}  # written before the file was mapped: the same examples
    notes = check_compatible(recorded, new_fp, checkpoint_shapes=shapes,
                             checkpoint_private=manifest.private, allow_new_data=config.checkpoints.allow_new_data)
    state = ckpt.load(source, mesh=manager.mesh, strategy=manager.strategy, specs=manager.specs,
                      rank=manager.coordinator.rank, private=manager.private, like=fresh)  # on the run's device
    state = restored(state, fresh)
    increased_from = None
    if dp is not None:
        spent = state.accountant
        p = config.privacy
        acc = check_budget_change(spent, epsilon_budget=p.budget, delta=p.delta,
                                  allow_increase=config.checkpoints.allow_budget_increase)
        acc = dataclasses.replace(acc, accountant=p.accountant, value_discretization_interval=p.accounting_interval)
        if acc.epsilon_budget != spent.epsilon_budget or acc.delta != spent.delta:
            increased_from = {"epsilon_budget": spent.epsilon_budget, "delta": spent.delta}
        state = state._replace(accountant=acc)
        last = acc.events[-1] if acc.events else None
        current = last.noise_multiplier if last is not None and last.sample_rate == dp.sample_rate else None
        dp = _plan_noise(config, dp, acc, current=current)
        dp = continued_mechanism(dp, wrote, source)
        check_noise_history(dp, state, source)
    entry = _entry(config, state.step, source, dp, new_fp, world, budget_changed_from=increased_from,
                   new_data=recorded is not None and recorded["data"] != new_fp["data"])
    resuming = config.checkpoints.resume or config.checkpoints.resume_if_present
    earlier = Path(record["run_dir"]) if record else (config.run_dir if resuming else None)
    return SegmentPlan(state, dp, state.step, source, [*lineage(segments, state.step), entry], earlier, notes,
                       segment_run)


def _same_legacy_data(recorded: str, digest: str) -> bool:
    """Whether a checkpoint's data digest from before token files were mapped (an int64 hash of
    the examples) is that of the mapped examples ``digest`` describes
    (:class:`fsdpx.train.segments.DataDigest`): computed, one pass over the file, only then."""
    legacy = getattr(digest, "legacy", None)
    return legacy is not None and recorded != digest and not recorded.startswith("v2:") and legacy() == recorded


def _plan_noise(config: RunConfig, dp: DPConfig | None, spent: Any, *, current: float | None) -> DPConfig | None:
    """``dp`` with the noise of the steps left; unchanged without a target (fixed noise)."""
    p = config.privacy
    if dp is None or p.target_epsilon is None:
        return dp
    target = p.target_epsilon if p.budget is None else min(p.target_epsilon, p.budget)
    sigma = segment_noise(spent, target=target, sample_rate=dp.sample_rate, steps=config.run.steps - spent.steps,
                          current=current, max_noise=p.max_noise_multiplier)
    return dp if sigma == dp.noise_multiplier else dataclasses.replace(dp, noise_multiplier=sigma)


class MechanismChangeError(ResumeError):
    """The run's noise mechanism (``--noise-mechanism``, ``--bands``, ``--buffers``,
    ``--min-separation``) differs from the one its
    checkpoint's steps used: a matrix-factorization mechanism's guarantee holds for one strategy
    over the whole run."""


def continued_mechanism(dp: DPConfig, wrote: Mapping[str, Any] | None, source: Path) -> DPConfig:
    """``dp`` with the mechanism the checkpoint's run used (its segment record's
    ``derived.mechanism``; records from before mechanisms existed: independent), so a resumed or
    branched banded or BLT run keeps its coefficients whatever its new ``--steps``. Raises
    :class:`MechanismChangeError` naming ``--noise-mechanism`` and the flags that differ (the kind,
    the bands, a BLT's buffers or min separation), or when a correlated run's checkpoint has no
    record to take them from
    (``tests/test_train_mechanisms.py::test_a_resume_continues_the_banded_mechanism_and_refuses_a_change``,
    ``tests/test_train_mechanisms.py::test_a_blt_run_resumes_bit_for_bit_and_refuses_other_buffers``)."""
    if wrote is None:
        if dp.mechanism.kind != "independent":
            raise MechanismChangeError(f"--noise-mechanism {dp.mechanism.kind}: the checkpoint {source} has no"
                                       " run.json record of the mechanism its steps used; it cannot be continued")
        return dp
    recorded = (wrote.get("derived") or {}).get("mechanism")
    used = Mechanism.from_dict(recorded) if recorded else INDEPENDENT
    if mechanism_words(used) != mechanism_words(dp.mechanism):
        raise MechanismChangeError(f"--noise-mechanism {mechanism_words(dp.mechanism)}: the checkpoint's steps used"
                                   f" --noise-mechanism {mechanism_words(used)}; the mechanism cannot change within a"
                                   " run")
    return dp if used == dp.mechanism else dataclasses.replace(dp, mechanism=used)


def recorded_mechanism(config: RunConfig) -> Mechanism | None:
    """The noise mechanism recorded by the run a resume or branch continues (the ``run.json`` of
    ``--ckpt-dir`` with ``resume`` / ``resume_if_present``, of ``--resume-from``'s root, the
    segment that wrote its step when it names one), so that the run does not optimise a BLT
    strategy it would not use; ``None`` for a fresh run, or when there is no record to read
    (nothing is checked here: :func:`plan_segment` checks and refuses, and keeps the checkpoint's
    own mechanism in any case) (``tests/test_train_mechanisms.py::
    test_a_blt_run_resumes_bit_for_bit_and_refuses_other_buffers``)."""
    c = config.checkpoints
    if c.resume_from is not None:
        path = Path(c.resume_from)
        named = (path / MANIFEST).is_file()
        root, step = (path.parent, step_of(path)) if named else (path, None)
    elif (c.resume or c.resume_if_present) and c.ckpt_dir is not None:
        root, step = Path(c.ckpt_dir), None
    else:
        return None
    try:
        segments = (read_record(root) or {}).get("segments") or []
    except (OSError, ValueError):
        return None
    wrote = owner(segments, step) if step is not None else (segments[-1] if segments else None)
    recorded = ((wrote or {}).get("derived") or {}).get("mechanism")
    return Mechanism.from_dict(recorded) if recorded else None


def mechanism_words(m: Mechanism) -> str:
    """The flags that choose mechanism ``m``: ``banded --bands 3``, ``blt --buffers 2 --min-separation 4``."""
    if m.kind == "blt":
        return f"blt --buffers {len(m.decays)} --min-separation {m.min_sep}"
    return m.kind + (f" --bands {m.bands}" if m.kind == "banded" else "")


def check_noise_history(dp: DPConfig, state: Any, source: Path) -> None:
    """Raise :class:`MechanismChangeError` naming ``--noise-mechanism`` when the checkpoint's state
    lacks the ``history_length`` entries its mechanism streams from (a banded one's ``bands - 1``
    past outputs, a BLT's ``D`` buffers: ``privacy.mechanisms.correlated``): a checkpoint saved
    before its noise was streamed cannot continue it; or when a BLT checkpoint's ledger accounts
    other coefficients than the run's record (its epsilon would not be this mechanism's)
    (``tests/test_train_mechanisms.py::test_a_checkpoint_without_the_noise_history_is_refused_by_flag``)."""
    ledger = dp.mechanism.ledger_fields["blt"]
    if ledger is not None and getattr(state.accountant, "blt", None) != ledger:
        raise MechanismChangeError(f"--noise-mechanism blt: the checkpoint {source} accounts BLT coefficients"
                                   f" {state.accountant.blt}, its run's record {ledger}; it cannot be continued")
    have, need = len(getattr(state, "noise_history", ())), dp.mechanism.history_length
    if have != need:
        raise MechanismChangeError(f"--noise-mechanism {dp.mechanism.kind}: the checkpoint {source} holds {have} past"
                                   f" noise outputs, its mechanism streams from {need} (saved before banded noise was"
                                   " streamed); it cannot be continued")


def _entry(config: RunConfig, start: int, source: Path | None, dp: DPConfig | None, fp: dict[str, Any], world: int,
           *, budget_changed_from: dict | None = None, new_data: bool = False) -> dict[str, Any]:
    """The segment's record: where it starts, from which checkpoint, its resolved values."""
    return json_safe({
        "start_step": start,
        "source_checkpoint": str(source.resolve()) if source is not None else None,
        "config": dataclasses.asdict(config),
        "derived": {"sample_rate": dp.sample_rate if dp else None,
                    "noise_multiplier": dp.noise_multiplier if dp else None, "world_size": world,
                    "mechanism": dp.mechanism.to_dict() if dp else None},
        "fingerprint": fp,
        "budget_changed_from": budget_changed_from,
        "new_data": new_data,
    })


def restarted_config(config: RunConfig, restart: int) -> RunConfig:
    """The configuration a worker runs after torchrun restarted its group ``restart`` times
    (``fsdpx train --max-restarts``): ``config`` itself on the first attempt; afterwards
    ``resume_if_present`` from ``ckpt_dir``: a resume from its newest intact checkpoint, which
    continues bit for bit where the failed attempt last saved (the noise plan keeps an unchanged
    run's noise), or the run started again when the failed attempt saved none. A branch
    (``resume_from``) whose own root holds no checkpoint yet starts again from its source, with
    ``overwrite`` (its run directory is the one its failed attempt wrote). Either way the
    preflight lets the restart write where the first attempt was allowed to.

    Guarantee: the restarted run ends with the same bits as one never interrupted
    (``tests/test_train_elastic.py``). Reads the checkpoint root, writes nothing."""
    c = config.checkpoints
    if restart == 0 or c.ckpt_dir is None:
        return config
    if c.resume_from is not None and ckpt.CheckpointManager(c.ckpt_dir).latest() is None:
        return config.replace(overwrite=True)
    return config.replace(resume=False, resume_if_present=True, resume_from=None)


# --------------------------------------------------------------------------- Python entry points


def merge_overrides(base: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """``base`` with ``overrides`` (flat names) applied; an override of one of two exclusive
    fields clears the other (``target_epsilon`` vs ``noise_multiplier``, ``batch_size`` vs
    ``sample_rate``), so a branch can switch from one to the other; an ``optimizer`` other than
    sgd clears an inherited ``momentum`` (SGD's), so the change is named by its own flag."""
    values = base.flat()
    values.update(overrides)
    for given, cleared in (("target_epsilon", "noise_multiplier"), ("noise_multiplier", "target_epsilon"),
                           ("batch_size", "sample_rate"), ("sample_rate", "batch_size")):
        if overrides.get(given) is not None and given in overrides and cleared not in overrides:
            values[cleared] = None
    if overrides.get("optimizer", "sgd") != "sgd" and "momentum" not in overrides:
        values["momentum"] = 0.0
    return RunConfig.of(**values)


PER_SEGMENT = {"resume": False, "resume_if_present": False, "resume_from": None, "allow_budget_increase": False,
               "allow_new_data": False, "overwrite": False, "config_file": None, "device": "cpu"}
"""Fields a segment never inherits from the one before it: how it starts, what it is allowed
to loosen or replace and where it runs (the machine may have changed) are asked for anew each time."""


def segment_config(base: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """The configuration of a new segment continuing ``base`` (the ``RunConfig`` that wrote its
    checkpoint): ``base`` with ``overrides`` (see :func:`merge_overrides`), the ``PER_SEGMENT``
    fields reset unless overridden, and for a branch (``resume_from``) its own checkpoint root
    unless one is given (never the source's)."""
    branch = {"ckpt_dir": None} if overrides.get("resume_from") is not None else {}
    return merge_overrides(base, {**PER_SEGMENT, **branch, **overrides})


def find_checkpoint(path: str | Path, *, verify: bool = True) -> Path:
    """The checkpoint ``path`` names: ``path`` itself when it is one (a ``step_<N>`` directory
    holding a manifest; checked against its checksums unless ``verify`` is False), else the
    newest intact checkpoint of the root ``path``. Raises :class:`CheckpointNotFoundError`
    naming ``path`` when it is neither, or when the checkpoint it names is corrupt
    (``tests/test_export.py::test_export_refuses_an_existing_directory_and_a_path_that_is_no_checkpoint``,
    ``tests/test_ckpt_resume.py``)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        if verify:
            try:
                ckpt.verify(path)
            except ckpt.CorruptCheckpointError as e:
                raise CheckpointNotFoundError(f"{path} is not an intact checkpoint: {e}") from None
        return path
    newest = ckpt.CheckpointManager(path).latest() if path.is_dir() else None
    if newest is None:
        raise CheckpointNotFoundError(f"{path} is neither a checkpoint (step_<N> with a {MANIFEST}) nor a directory"
                                      " holding an intact one")
    return newest


def source_config(path: str | Path) -> RunConfig | None:
    """The ``RunConfig`` of the segment that wrote the checkpoint ``path`` (a ``step_<N>``
    directory or a root: its newest intact one), from its root's ``run.json``; ``None`` when the
    root has no record."""
    try:
        path = find_checkpoint(path, verify=False)
    except CheckpointNotFoundError:
        return None
    except PermissionError:  # a root that cannot be read: the preflight refuses it, naming the flag
        return None
    record = read_record(path.parent)
    manifest = ckpt.read_manifest(path)
    wrote = owner(record["segments"], manifest.step) if record else None
    if wrote is None:
        return None
    return RunConfig.from_dict(wrote["config"])


def resume_from(path: str | Path, overrides: Mapping[str, Any] | None = None) -> tuple[Any, DPConfig | None]:
    """The train state of the checkpoint ``path`` and the :class:`DPConfig` of the steps left,
    for research code continuing a run outside ``fsdpx train`` (one process).

    The configuration is the one that wrote the checkpoint (its root's ``run.json``) with
    ``overrides`` applied (``RunConfig`` field names, e.g. ``{"lr": 3e-3, "steps": 40}``;
    ``allow_budget_increase`` / ``allow_new_data`` as in the CLI). Returns ``(state, dp)``:
    ``state`` a :class:`privacy.step.TrainState` whose accountant carries the run's exact history
    and this segment's budget (so every ``make_private_step`` step checks it), ``dp`` the
    recalibrated privacy (``None`` for a non-private run).

    Guarantees: the CLI's (:func:`plan_segment`): the noise keeps the whole run within its
    target, refused changes raise the named errors, nothing is written
    (``tests/test_train_segments.py::test_resume_from_in_python_gives_the_cli_noise_and_state``).
    Raises :class:`CheckpointNotFoundError` for a path without an intact checkpoint and
    ``ResumeError`` when the root has no ``run.json`` to take the configuration from."""
    base = source_config(path)
    if base is None:
        raise ResumeError(f"{path}: no run.json beside the checkpoint to take the configuration from;"
                          " start from a RunConfig and fsdpx.train.run(RunConfig.of(resume_from=...)) instead")
    config = segment_config(base, {**(overrides or {}), "resume_from": str(path), "strategy": None, "tp": 1, "pp": 1,
                                   "sequence_parallel": False})
    source = build_source(config)
    num_examples = int(source.inputs.shape[0])
    sample_rate = resolve_sample_rate(config, num_examples)
    dp = resolve_privacy(config, sample_rate, recorded=recorded_mechanism(config))
    fresh, _ = build_step(config, source.model, source.params, dp, num_examples=num_examples,
                          loss_fn=source.loss_fn)
    manager = checkpoint_manager(config, None, private=dp is not None)
    plan = plan_segment(config, params=source.params, fresh=fresh, dp=dp,
                        digest=data_digest(source.inputs, source.targets), manager=manager, data=source.description)
    return plan.state, plan.dp
