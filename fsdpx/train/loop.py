"""The training loop of ``fsdpx train``: the model and data of a :class:`RunConfig` (by default
a small GPT on the embedded corpus, :mod:`fsdpx.train.sources`), privately by default.

    summary = run(RunConfig(steps=300, target_epsilon=8.0))

The core is the pure step from :mod:`privacy.step` (or :func:`make_plain_step` for the
non-private baseline); this module only decides which step to build, feeds it Poisson batches
and records what it returns. Side effects live in a few named helpers at the bottom: the run
directory, ``metrics.jsonl``, ``config.json``, ``plot.png`` and the progress bar.

Files written to ``<out>/<name>/``:

* ``config.json``: the :class:`RunConfig` plus what was derived from it (sample rate, noise
  multiplier, dataset and model sizes, the model and data read), written before the first step;
  ``config.toml``: the same configuration as a file ``fsdpx train --config`` reads back.
* ``metrics.jsonl``: one object per step: ``step`` (1-based), ``loss`` (mean over the batch),
  ``epsilon`` (spent after the step, at ``delta``; ``null`` for a non-private run, which has no
  guarantee), ``batch_size`` (the Poisson draw), ``clipped_fraction``, ``mean_norm`` (mean
  per-example gradient norm before clipping; ``null`` when not computed), ``seconds`` (wall
  time since the loop started).
* ``plot.png``: loss and epsilon against step.

Where later features plug in: :func:`build_step` is the one place a step function is made
(a sharded or offloaded step would be chosen there), and the loop starts at ``state.step`` so a
state restored from a checkpoint continues where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor
from tqdm import tqdm

import offload
from fsdpx.models.gpt import token_loss
from fsdpx.optim import Optimizer, adamw
from fsdpx.optim.freezing import Freezing, Trainable, bind
from fsdpx.runtime import init_sharded, make_sharded_step, plain_step
from fsdpx.sharding import strategies
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.mesh import Mesh
from fsdpx.runtime.stages import check_stages, traced_prologue
from fsdpx.sharding.pipeline import PipelineParallel, PipelinePlanError, find_blocks, resolve_pipeline, unshard_stages
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.tensor_parallel import resolve
from privacy.accounting import Accountant, noise_multiplier
from privacy.errors import BudgetExhaustedError
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, TrainState, init_state, make_private_step, sample_batch

from .config import ConfigError, RunConfig, to_toml
from .device import run_device, to_device
from .segments import BranchError, cut_back, data_digest, read_metrics, write_metrics, write_record
from .sources import Source, build_source, sample_text, tp_plan

Step = Callable[[TrainState, tuple[Tensor, Tensor]], tuple[TrainState, dict[str, float]]]

SMOOTHING = 10  # steps averaged for the reported final loss and the plot's trend line


# --------------------------------------------------------------------------- planning (pure)


def resolve_sample_rate(config: RunConfig, num_examples: int) -> float:
    """The Poisson sample rate: ``sample_rate``, or ``batch_size / num_examples``. Raises
    :class:`ConfigError` when the expected batch would be larger than the dataset."""
    if config.sample_rate is not None:
        return config.sample_rate
    if config.batch_size > num_examples:
        raise ConfigError(f"batch_size={config.batch_size:g} is larger than the dataset ({num_examples} examples)")
    return config.batch_size / num_examples


def resolve_privacy(config: RunConfig, sample_rate: float) -> DPConfig | None:
    """The :class:`DPConfig` of a private run (``None`` for a non-private one). With
    ``target_epsilon``, sigma is the smallest noise multiplier whose epsilon over ``steps`` at
    ``delta`` is at most the target, by the same accountant the run reports with. Invalid
    privacy values raise :class:`privacy.errors.PrivacyError` naming them."""
    if not config.private:
        return None
    sigma = config.noise_multiplier
    if sigma is None:
        sigma = noise_multiplier(config.target_epsilon, config.delta, sample_rate, config.steps,
                                 accountant=config.accountant,
                                 value_discretization_interval=config.accounting_interval)
    return DPConfig(clip_norm=config.clip_norm, noise_multiplier=sigma, sample_rate=sample_rate,
                    delta=config.delta, method=config.method, clipping=config.clipping,
                    epsilon_budget=epsilon_budget(config), accountant=config.accountant)


def epsilon_budget(config: RunConfig) -> float | None:
    """The epsilon no step may exceed: ``epsilon_budget`` when given, else the target the run
    announced (a run "to epsilon 8" never takes a step past 8, resumed or not); None for a
    non-private run or one with a fixed noise multiplier and no budget."""
    if not config.private:
        return None
    return config.epsilon_budget if config.epsilon_budget is not None else config.target_epsilon


# --------------------------------------------------------------------------- steps


def make_plain_step(model: torch.nn.Module, loss_fn: Callable, optimizer: Optimizer,
                    trainable: Trainable | None = None) -> Step:
    """Non-private baseline with the private step's signature: :func:`fsdpx.runtime.plain_step.make_plain_step`
    (the mean gradient of the batch, no clipping, no noise) on a :class:`TrainState`. The
    accountant records noise multiplier 0, so ``epsilon`` is ``inf``: plain training gives no
    guarantee. An empty batch leaves the gradient zero. ``trainable``: a freezing schedule, as
    :func:`fsdpx.runtime.plain_step.make_plain_step` takes it."""
    plain = plain_step.make_plain_step(model, loss_fn, optimizer, trainable=trainable)

    def step(state: TrainState, batch: tuple[Tensor, Tensor]) -> tuple[TrainState, dict[str, float]]:
        new, metrics = plain(plain_step.PlainState(state.params, state.opt_state, state.step), batch)
        accountant = state.accountant.record(0.0, 1.0)
        metrics = {**metrics, "clipped_fraction": 0.0, "mean_norm": math.nan}
        return TrainState(new.params, new.opt_state, new.step, state.key, accountant), metrics

    return step


def build_step(config: RunConfig, model: torch.nn.Module, params: dict[str, Tensor], dp: DPConfig | None,
               *, num_examples: int, comm: Comm | None = None,
               loss_fn: Callable[[Any, Tensor], Tensor] = token_loss,
               example: Tensor | None = None) -> tuple[TrainState, Step]:
    """The initial state and the step function of a run: the one place a step is chosen.

    Returns ``(state, step)`` with ``state.step == 0``. The accountant carries the run's delta,
    budget and PLD discretization, so the epsilon it reports is the one ``resolve_privacy``
    calibrated against. With ``comm`` (a sharded run) the state is this rank's
    :class:`fsdpx.runtime.ShardedState` and the step takes the global batch. ``loss_fn(model
    output, targets) -> (B,)``: the source's (:attr:`fsdpx.train.sources.Source.loss_fn`);
    ``example``: one of its inputs, to trace a pipeline's prologue (:func:`sharding_plan`)."""
    optimizer = make_optimizer(config, comm)
    trainable = freezing(config, model, params)
    accountant = Accountant(accountant=config.accountant, delta=config.delta,
                            epsilon_budget=epsilon_budget(config),
                            value_discretization_interval=config.accounting_interval)
    if comm is not None:
        strategy = sharding_plan(config, model, comm.mesh, example)
        check_pipeline(model, strategy, example)
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        step = make_sharded_step(model, loss_fn, optimizer, strategy, comm, param_shapes=shapes, config=dp,
                                 num_examples=num_examples, donate=True, trainable=trainable)
        state = init_sharded(params, optimizer, strategy, comm, key=config.seed, config=dp)
        return state._replace(accountant=accountant), step
    if dp is None:
        fresh = {k: v.clone() for k, v in params.items()}
        state = TrainState(fresh, optimizer.init(fresh), 0, config.seed, accountant)
        return state, make_plain_step(model, loss_fn, optimizer, trainable=trainable)
    state = init_state(params, optimizer, key=config.seed, config=dp)._replace(accountant=accountant)
    return state, make_private_step(model, loss_fn, optimizer, dp, num_examples=num_examples, donate=True,
                                    trainable=trainable)


def make_optimizer(config: RunConfig, comm: Comm | None) -> Optimizer:
    """AdamW, wrapped by the configured offload. In a sharded run ZenFlow scores columns over
    the rows of every rank (one all-reduce of ``in`` floats per weight), so all ranks select
    what one unsharded run would."""
    inner = adamw(config.lr)
    if config.offload == "zero":
        return offload.zero_offload(inner)
    if config.offload == "none":
        return inner
    combine = None
    if comm is not None:
        strategy = strategies.ALL[config.strategy](**strategy_axes(config.strategy))
        rows = strategy.opt_state(2).axes(0)  # the axes a weight's rows are split over, if any
        combine = offload.sharded_scores(comm, rows) if rows else None
    interval = config.offload_interval
    return offload.zenflow(inner, topk_ratio=config.offload_topk, update_interval=interval,
                           select_interval=interval * max(1, 100 // interval), combine_scores=combine)


def offload_metrics(state: Any) -> dict[str, float]:
    """The offload optimizer's last-step metrics (loop wait on the host, bytes each way), if any."""
    opt = state.opt_state
    found = opt.get("metrics") if isinstance(opt, dict) else None
    return {f"offload_{k}": v for k, v in found.items()} if found else {}


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


def strategy_axes(name: str) -> dict[str, str]:
    """Keyword arguments naming the mesh axes of a strategy in :func:`run_mesh`."""
    return {"replica_axis": "replica", "shard_axis": "shard"} if name == "hsdp" else {"axis": "dp"}


def run_mesh(strategy: str, world: int, tp: int = 1, pp: int = 1) -> Mesh:
    """The mesh of a sharded run over ``world`` processes: ``dp=world / (tp pp)``; for hsdp,
    shards of 2 (or of all data ranks when their count is odd) replicated over the rest; with
    ``tp > 1`` an axis ``tp`` (tensor-parallel ranks adjacent, as Megatron places them), with
    ``pp > 1`` a first axis ``pp`` (stages farthest apart: their traffic is the lightest).
    Raises :class:`ConfigError` when ``tp * pp`` does not divide ``world``."""
    if world % (tp * pp):
        raise ConfigError(f"tp={tp} x pp={pp} does not divide the {world} processes")
    data = world // (tp * pp)
    extra = {**({"pp": pp} if pp > 1 else {}), **({"tp": tp} if tp > 1 else {})}
    if pp > 1:  # Mesh keeps keyword order: put pp first, the slowest-varying axis
        if strategy != "hsdp":
            return Mesh(pp=pp, dp=data, **({"tp": tp} if tp > 1 else {}))
        shard = 2 if data % 2 == 0 else data
        return Mesh(pp=pp, replica=data // shard, shard=shard, **({"tp": tp} if tp > 1 else {}))
    if strategy != "hsdp":
        return Mesh(dp=data, **extra)
    shard = 2 if data % 2 == 0 else data
    return Mesh(replica=data // shard, shard=shard, **extra)


def sharding_plan(config: RunConfig, model: torch.nn.Module, mesh: Mesh, example: Tensor | None = None) -> ShardingPlan:
    """The run's per-parameter layouts: the strategy's, with the model's tensor-parallel plan
    (:func:`fsdpx.train.sources.tp_plan`) when ``config.tp > 1`` and its blocks cut into
    pipeline stages when ``config.pp > 1``, the prologue traced on ``example`` (one of the
    run's inputs, :func:`pipeline_prologue`). Every call of one run passes the same example (or
    none), so its plans agree."""
    return resolve_plan(model, mesh, strategy=config.strategy, tp=config.tp, pp=config.pp, schedule=config.schedule,
                        microbatches=config.microbatches, virtual_stages=config.virtual_stages,
                        sequence_parallel=config.sequence_parallel,
                        prologue=pipeline_prologue(model, example) if config.pp > 1 else None)


def pipeline_prologue(model: torch.nn.Module, example: Tensor | None) -> tuple[str, ...] | None:
    """The parameters ``model``'s forward uses before its block list, traced on ``example`` (a
    batch of one of the run's inputs): ``PipelineParallel.prologue``, so that a model
    registered in another order than its forward runs (transformers' OPT) is cut right. None
    without an example or for a model on ``meta`` (registration order is taken; a wrong side is
    named at the first step). Raises :class:`ConfigError` where the trace fails
    (``PipelinePlanError``)."""
    if example is None or any(p.is_meta for p in model.parameters()):
        return None
    try:
        return traced_prologue(model, find_blocks(model), example)
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None


def check_pipeline(model: torch.nn.Module, plan: ShardingPlan, example: Tensor | None) -> None:
    """Raise :class:`ConfigError` unless each stage of ``plan``'s pipeline, run alone from the
    hidden state it receives, computes what the whole model does at that point on ``example``
    (:func:`fsdpx.runtime.stages.check_stages`: blocks that pass state besides the hidden state,
    such as T5's position bias, cannot be pipelined). Nothing to check without a pipeline or an
    example, or for a model on ``meta``."""
    if plan.pipeline is None or example is None or any(p.is_meta for p in model.parameters()):
        return
    try:
        check_stages(model, plan.pipeline, example)
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None


def resolve_plan(model: torch.nn.Module, mesh: Mesh, *, strategy: str, tp: int = 1, pp: int = 1,
                 schedule: str = "1f1b", microbatches: int = 4, virtual_stages: int = 1,
                 sequence_parallel: bool = False, prologue: tuple[str, ...] | None = None) -> ShardingPlan:
    """:func:`sharding_plan` from its parts (``model`` may live on ``meta``): the planner resolves
    the plans it considers with it. ``prologue``: ``PipelineParallel.prologue`` (None:
    registration order). Raises :class:`ConfigError` for a model without a
    tensor-parallel plan or a pipeline that does not fit, ``TensorParallelPlanError`` for a plan
    that does not fit the model or the mesh."""
    data = strategies.ALL[strategy](**strategy_axes(strategy))
    tensor = tp_plan(model, tp, sequence_parallel=sequence_parallel) if tp > 1 else None
    plan = resolve(model, tensor, data, mesh)
    if pp == 1:
        return plan
    spec = PipelineParallel(schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                            prologue=prologue)
    try:
        return resolve_pipeline(model, plan, spec, mesh)
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None


def check_layout(config: RunConfig, world: int) -> Source:
    """Raise :class:`ConfigError` if the run's device is missing (:class:`DeviceUnavailableError`:
    ``cuda`` without a GPU for each of ``world`` processes), its model and data cannot be built, or its mesh or
    sharding plan on ``world`` processes (a tp x pp that does not divide it, a pipeline
    schedule that cannot run the microbatches, a model without a tensor-parallel plan): checked
    once, before torchrun starts any process. Returns the source it built."""
    run_device(config.device, processes=world)  # cuda without a GPU for each process: refused now
    source = build_source(config)
    freezing(config, source.model, source.params)
    mesh = run_mesh(config.strategy, world, config.tp, config.pp)
    check_pipeline(source.model, sharding_plan(config, source.model, mesh, source.inputs[:1]), source.inputs[:1])
    return source


def freezing(config: RunConfig, model: torch.nn.Module, params: dict[str, Tensor]) -> Freezing | None:
    """The run's freezing schedule (``config.freeze`` parsed), every name in it resolved against
    ``model``'s parameters now; ``None`` without one. Raises :class:`ConfigError` naming a name
    that matches no parameter, before any step or file."""
    if not config.freeze:
        return None
    schedule = Freezing.parse(config.freeze)
    try:
        bind(schedule, model, params)  # resolves every name of the schedule
    except KeyError as err:
        raise ConfigError(f"freeze {config.freeze!r}: {err.args[0]}") from None
    return schedule


def full_params(state: Any, config: RunConfig, comm: Comm | None, source: Source) -> dict[str, Tensor]:
    """The whole parameters: ``state.params`` in one process; in a sharded run every rank's
    blocks, gathered and unsharded on the host (called on every rank)."""
    if comm is None:
        return state.params
    plan = sharding_plan(config, source.model, comm.mesh, source.inputs[:1])
    blocks = comm.all_gather_object({k: v.cpu() for k, v in state.params.items()})  # pickled through the host
    whole = unshard_stages(blocks, plan, comm.mesh)
    return {k: whole[k].reshape(source.params[k].shape) for k in plan.params}


def checkpoint_manager(config: RunConfig, comm: Comm | None, *, private: bool, model: torch.nn.Module,
                       example: Tensor | None = None):
    """The run's :class:`ckpt.CheckpointManager` (``None`` without ``ckpt_dir``): the sharded
    state is saved in its own layout by every rank and can be restored into another
    (``example``: as :func:`build_step`'s)."""
    if config.ckpt_dir is None:
        return None
    import ckpt

    if comm is None:
        return ckpt.CheckpointManager(config.ckpt_dir, keep_last=3, every_n_steps=config.ckpt_every, private=private)
    plan = sharding_plan(config, model, comm.mesh, example)  # tensors saved in this run's layouts
    return ckpt.CheckpointManager(config.ckpt_dir, mesh=comm.mesh, strategy=plan,
                                  coordinator=ckpt.TorchDistCoordinator(), keep_last=3,
                                  every_n_steps=config.ckpt_every, private=private)


# --------------------------------------------------------------------------- the run


def run(config: RunConfig, *, progress: bool = True, comm: Comm | None = None) -> dict[str, Any]:
    """Train as ``config`` says (one segment of a run), write the run directory, and return the summary.

    Returns a dict with ``steps`` (the run's step count at the end, earlier segments included),
    ``start_step`` (where this segment began), ``initial_loss`` (the run's first recorded step's,
    i.e. the untrained model's) and ``initial_step``, ``final_loss`` (mean over the last
    ``SMOOTHING`` steps), ``epsilon`` spent at ``delta`` over the whole run (``inf`` for a
    non-private run), ``noise_multiplier`` (of this segment), ``sample_rate``, ``seconds`` (wall
    time of the segment), ``run_dir``, ``sample`` (text generated by the trained model),
    ``segment_starts`` and ``stopped`` (why the segment ended early, or ``None``).

    Segments (:func:`fsdpx.train.resume.plan_segment`): with ``resume`` or ``resume_from`` the
    run continues from a checkpoint; the noise of the steps left is planned against the privacy
    budget and the exact history, and every refusal (``fsdpx.train.segments.ResumeError``,
    ``fsdpx.train.budget.BudgetError``, ``ConfigError``, ``PrivacyError``) is raised before
    anything is written. ``metrics.jsonl`` is cut back to the starting step (a branch starts with
    its source's steps ``1..start``), ``config.json`` and the checkpoint root's ``run.json`` list
    the segments. A checkpoint already at ``steps`` trains nothing, writes nothing and says so
    in ``stopped``. A step that would exceed the budget is not taken: the run stops there.

    Sharded (``comm`` given, every rank calls ``run``): every rank feeds the same global Poisson
    batch to its sharded step; only rank 0 writes files and shows progress."""
    from .resume import plan_segment  # resume imports this module

    main = comm is None or comm.rank == 0
    start = time.perf_counter()
    # refused here, before any file: cuda without a GPU (a torchrun rank's comm already holds its device)
    device = getattr(comm, "device", None) or run_device(config.device)
    source = build_source(config).to(device)  # built on the host (the same bits anywhere), then moved
    model, params, inputs, targets = source.model, source.params, source.inputs, source.targets
    num_examples = int(inputs.shape[0])
    sample_rate = resolve_sample_rate(config, num_examples)
    dp = resolve_privacy(config, sample_rate)
    example = inputs[:1]  # traces a pipeline's prologue: every plan of the run from the same one
    state, step = build_step(config, model, params, dp, num_examples=num_examples, comm=comm, loss_fn=source.loss_fn,
                             example=example)
    manager = checkpoint_manager(config, comm, private=dp is not None, model=model, example=example)
    plan = plan_segment(config, params=params, fresh=state, dp=dp, digest=data_digest(inputs, targets),
                        manager=manager, world=comm.mesh.size if comm else 1, data=source.description)
    if config.resume_from is not None:
        check_branch(config, plan)
    if plan.dp != dp:
        if main and plan.start > 0:
            print(f"fsdpx train: noise multiplier {plan.dp.noise_multiplier:.4g} (was {dp.noise_multiplier:.4g}) for"
                  f" the {config.steps - plan.start} steps left keeps the whole run within epsilon"
                  f" {config.target_epsilon:g}", file=sys.stderr)
        dp = plan.dp
        _, step = build_step(config, model, params, dp, num_examples=num_examples, comm=comm,
                             loss_fn=source.loss_fn, example=example)
    state = plan.state
    earlier = cut_back(read_metrics(plan.earlier_run_dir / "metrics.jsonl"), plan.start) if plan.earlier_run_dir \
        else []
    if main:
        for note in plan.notes:
            print(f"fsdpx train: note: {note}", file=sys.stderr)
        if config.resume and plan.source is None:
            print(f"fsdpx train: no checkpoint in {config.ckpt_dir}; starting at step 0", file=sys.stderr)
        elif plan.source is not None:
            print(f"fsdpx train: resuming at step {plan.start} from {plan.source}", file=sys.stderr)
    starts = [s["start_step"] for s in plan.segments if s["start_step"] > 0]
    if plan.start >= config.steps:
        stopped = (f"nothing to do: the checkpoint {plan.source} is at step {plan.start} and --steps is"
                   f" {config.steps}; ask for more steps to train further")
        if main:
            print(f"fsdpx train: {stopped}", file=sys.stderr)
        trained = full_params(state, config, comm, source)
        return _summary(config, [_numbers(r) for r in earlier], state, dp, sample_rate, start, plan.start, starts,
                        stopped, sample=sample_text(source, trained, 100, seed=config.seed))

    run_dir = _prepare_run_dir(config.run_dir) if main else config.run_dir
    _write_json(run_dir / "config.json" if main else None, {
        **dataclasses.asdict(config),
        "derived": {"num_examples": num_examples, "sample_rate": sample_rate, "vocab_size": source.vocab_size,
                    "model": source.model_name, "data": source.description,
                    "world_size": comm.mesh.size if comm else 1, "mesh": repr(comm.mesh) if comm else None,
                    "noise_multiplier": dp.noise_multiplier if dp else None,
                    "num_params": sum(p.numel() for p in params.values())},
        "segments": plan.segments,
    })
    if main:
        (run_dir / "config.toml").write_text(to_toml(config))
        write_metrics(run_dir / "metrics.jsonl", earlier)  # cut back to the start: no step twice
        if config.ckpt_dir is not None:
            write_record(config.ckpt_dir, {"run_dir": str(config.run_dir.resolve()), "segments": plan.segments})
    sampler = PoissonSampler(num_examples, sample_rate, key=config.seed)

    history: list[dict[str, Any]] = [_numbers(r) for r in earlier]
    saved_at = plan.start
    stopped, torn = None, False
    loop_start = time.perf_counter()
    with _open_log(run_dir / "metrics.jsonl", main, append=True) as log, \
            _progress_bar(config, progress and main, initial=plan.start) as bar:
        while state.step < config.steps:
            try:
                # sampled on the host (the data stays there), moved as the step takes it
                batch = to_device(sample_batch((inputs, targets), sampler, state.step), device)
                state, metrics = step(state, batch)
            except BudgetExhaustedError as err:
                stopped = str(err)
                break
            except KeyboardInterrupt:  # keep what was trained: still plot and summarise
                # The step updates the donated state in place: interrupted inside it, `state`
                # may be half old, half new, so it is not saved (the last checkpoint stands).
                stopped, torn = "interrupted", True
                break
            # The step does not report epsilon (a PLD query is not free); on the run's coarse
            # grid (accounting_interval) one query per step costs tens of milliseconds.
            epsilon = state.accountant.epsilon() if main else math.nan
            record = {"step": state.step, **metrics, **offload_metrics(state), "epsilon": epsilon,
                      "seconds": time.perf_counter() - loop_start}
            history.append(record)
            _append_jsonl(log, record)
            _update_bar(bar, history)
            if manager is not None and manager.should_save(state.step):
                manager.save(state.step, savable(state), blocking=False)  # snapshot now, write in the background
                saved_at = state.step
    if manager is not None:
        if saved_at != state.step and not torn:
            manager.save(state.step, savable(state), force=True, blocking=False)
        manager.wait()

    trained = full_params(state, config, comm, source)
    if main:
        _plot(history, run_dir / "plot.png", title=_plot_title(config, dp, source), delta=config.delta, starts=starts)
    return _summary(config, history, state, dp, sample_rate, start, plan.start, starts, stopped,
                    sample=sample_text(source, trained, 100, seed=config.seed))


def check_branch(config: RunConfig, plan: Any) -> None:
    """Raise :class:`fsdpx.train.segments.BranchError` if a branch would write where its source
    lives: into the source's checkpoint root (its retention could delete the source's
    checkpoints), into the source's run directory, or into a root already holding checkpoints
    (``tests/test_train_segments.py::test_a_branch_never_writes_where_its_source_lives``)."""
    from ckpt.manager import committed_steps

    root = Path(config.ckpt_dir).resolve()
    if plan.source is not None and root == plan.source.parent.resolve():
        raise BranchError(f"the branch's checkpoint root {config.ckpt_dir} is its source's: its retention could"
                          " delete the source's checkpoints; give it another --ckpt-dir (default <out>/<name>/ckpt)")
    if plan.earlier_run_dir is not None and plan.earlier_run_dir.resolve() == config.run_dir.resolve():
        raise BranchError(f"the branch would write into its source's run directory {config.run_dir}; give it"
                          " another --name")
    if committed_steps(root):
        raise BranchError(f"{config.ckpt_dir} already holds checkpoints {committed_steps(root)}: continue that"
                          " branch with --resume, or give this one another --name or --ckpt-dir")


def _numbers(record: dict[str, Any]) -> dict[str, Any]:
    """A record read back from ``metrics.jsonl`` with its nulls (non-finite values) as NaN."""
    return {**record, **{k: math.nan for k in ("loss", "epsilon") if record.get(k) is None}}


def _summary(config: RunConfig, history: list[dict[str, Any]], state: Any, dp: DPConfig | None,
             sample_rate: float, start: float, start_step: int, starts: list[int], stopped: str | None,
             *, sample: str) -> dict[str, Any]:
    rows = [r for r in history if r.get("loss") is not None and math.isfinite(r["loss"])]
    return {
        "steps": state.step,
        "start_step": start_step,
        "initial_loss": rows[0]["loss"] if rows else math.nan,
        "initial_step": rows[0]["step"] if rows else None,
        "final_loss": _mean([r["loss"] for r in rows[-SMOOTHING:]]),
        "epsilon": state.accountant.epsilon(),
        "delta": config.delta,
        "noise_multiplier": dp.noise_multiplier if dp else 0.0,
        "sample_rate": sample_rate,
        "seconds": time.perf_counter() - start,
        "run_dir": str(config.run_dir),
        "sample": sample,
        "segment_starts": starts,
        "stopped": stopped,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The few lines ``fsdpx train`` prints at the end: the whole run's steps, loss and epsilon
    (a resumed run's first loss is its step 1's, not the segment's)."""
    s = summary
    privacy = (f"epsilon {s['epsilon']:.3f} at delta {s['delta']:g} (noise multiplier {s['noise_multiplier']:.3f}, "
               f"sample rate {s['sample_rate']:.4g})" if math.isfinite(s["epsilon"]) else "non-private: no guarantee")
    segment = (f"  (segments start at steps {', '.join(map(str, s['segment_starts']))}; this one trained"
               f" {s['steps'] - s['start_step']} from step {s['start_step']})" if s["segment_starts"] else "")
    first = f"at step {s['initial_step']}" if s["initial_step"] is not None else "(no step recorded)"
    lines = [
        f"steps        {s['steps']}{segment}" + (f"  (stopped early: {s['stopped']})" if s["stopped"] else ""),
        f"loss         {s['initial_loss']:.3f} {first} -> {s['final_loss']:.3f} (mean of the last {SMOOTHING} steps)",
        f"privacy      {privacy}",
        f"wall time    {s['seconds']:.1f} s",
        f"sample       {s['sample']!r}",
        f"files        {s['run_dir']}/{{metrics.jsonl,plot.png,config.json,config.toml}}",
    ]
    return "\n".join(lines)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


# --------------------------------------------------------------------------- side effects


def _prepare_run_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _open_log(path: Path, main: bool, *, append: bool = False):
    """``metrics.jsonl`` opened for writing (appending on resume) on the main rank; a sink
    elsewhere."""
    with open(path if main else os.devnull, "a" if append else "w") as log:
        yield log


def json_safe(x: Any) -> Any:
    # JSON has no inf/nan: a float that is not finite is written as null.
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _write_json(path: Path | None, obj: dict[str, Any]) -> None:
    if path is None:  # not the main rank
        return
    path.write_text(json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n")


def _append_jsonl(log, record: dict[str, Any]) -> None:
    log.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
    log.flush()


def _progress_bar(config: RunConfig, enabled: bool, initial: int = 0) -> tqdm:
    return tqdm(total=config.steps, initial=initial, desc=config.name, unit="step", disable=not enabled,
                dynamic_ncols=True)


def _update_bar(bar: tqdm, history: list[dict[str, Any]]) -> None:
    recent = [r["loss"] for r in history[-SMOOTHING:] if math.isfinite(r["loss"])]
    eps = history[-1]["epsilon"]
    bar.set_postfix(loss=f"{_mean(recent):.3f}", eps=f"{eps:.2f}" if math.isfinite(eps) else "inf", refresh=False)
    bar.update(1)


def _plot_title(config: RunConfig, dp: DPConfig | None, source: Source) -> str:
    model = f"{source.model_name}, block {config.block_size}" if source.language_model else source.model_name
    if dp is None:
        return f"{config.name}: {model}, non-private"
    return f"{config.name}: {model}, DP-SGD sigma={dp.noise_multiplier:.3f}, q={dp.sample_rate:.4f}, C={dp.clip_norm:g}"


def _plot(history: list[dict[str, Any]], path: Path, *, title: str, delta: float, starts: list[int] = ()) -> None:
    import matplotlib  # imported here: it is slow to import and the backend must be set first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    trend = [_mean([x for x in losses[max(0, i - SMOOTHING + 1): i + 1] if math.isfinite(x)])
             for i in range(len(losses))]
    fig, (ax_loss, ax_eps) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="loss (batch)")
    ax_loss.plot(steps, trend, color="tab:blue", linewidth=2, label=f"loss ({SMOOTHING}-step mean)")
    ax_loss.set_ylabel("loss (nats / token)")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)
    epsilons = [r["epsilon"] for r in history]
    for at in starts:  # where a resume or branch began
        for ax in (ax_loss, ax_eps):
            ax.axvline(at + 0.5, color="gray", linestyle="--", linewidth=1)
        ax_loss.text(at + 0.5, 1.0, f" resumed at {at}", transform=ax_loss.get_xaxis_transform(), fontsize=8,
                     color="gray", va="top")
    if epsilons and all(math.isfinite(e) for e in epsilons):
        ax_eps.plot(steps, epsilons, color="tab:red", linewidth=2)
    else:
        ax_eps.text(0.5, 0.5, "non-private: epsilon is infinite", ha="center", va="center", transform=ax_eps.transAxes)
        ax_eps.set_yticks([])
    ax_eps.set_ylabel(f"epsilon (delta={delta:g})")
    ax_eps.set_xlabel("step")
    ax_eps.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
