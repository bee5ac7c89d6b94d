"""Building a run's step: its privacy, optimizer and freezing resolved from the configuration,
and :func:`build_step`, the one place a step function is chosen (plain or private, one process
or sharded, offloaded or not).

    dp = resolve_privacy(config, resolve_sample_rate(config, len(inputs)))
    state, step = build_step(config, model, params, dp, num_examples=len(inputs))

The step is pure (:mod:`privacy.step`, :mod:`fsdpx.runtime`); this module only decides which one
to build. A sharded run passes its :class:`fsdpx.train.parallel.Parallel`, resolved once.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from typing import Any, Callable

import torch
from torch import Tensor

import offload
from fsdpx.models.gpt import token_loss
from fsdpx.optim import Optimizer, adamw, sgd
from fsdpx.optim.freezing import Freezing, Trainable, bind
from fsdpx.runtime import init_sharded, make_sharded_step, plain_step
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.plan import ShardingPlan
from privacy.accounting import Accountant, noise_multiplier
from privacy.mechanisms import (INDEPENDENT, CyclicPoissonSampler, Mechanism, blt_mechanism, blt_noise_multiplier,
                                optimal_banded, optimal_blt, participations)
from privacy.precision import compute_in
from privacy.step import DPConfig, TrainState, init_state, make_private_step

from .config import RunConfig
from .device import run_device
from .errors import ConfigError
from .parallel import Parallel, resolve_parallel
from .pretrained import ReadLog, Weights, file_names, read_block
from .sources import Source, build_source

Step = Callable[[TrainState, tuple[Tensor, Tensor]], tuple[TrainState, dict[str, float]]]


def resolve_sample_rate(config: RunConfig, num_examples: int) -> float:
    """The Poisson sample rate: ``sample_rate``, or ``batch_size / num_examples``; for a banded
    or BLT mechanism the rate within one of its groups (``bands``, ``min_separation``),
    ``batch_size / (num_examples // groups)``. Raises :class:`ConfigError` naming the flag when
    there are more groups than examples or the expected batch would be larger than the dataset."""
    p = config.privacy
    flag = {"banded": "--bands", "blt": "--min-separation"}.get(p.noise_mechanism)
    if p.groups > num_examples:
        raise ConfigError(f"{flag} {p.groups} is larger than the dataset ({num_examples} examples): every one of"
                          f" its {p.groups} cyclic groups needs an example")
    if p.sample_rate is not None:
        return p.sample_rate
    if p.groups > 1:  # cyclic Poisson: the rate within the active group (privacy.mechanisms.cyclic_sampling)
        if p.batch_size * p.groups > num_examples:
            raise ConfigError(f"batch_size={p.batch_size:g} x {flag} {p.groups} is larger than the dataset"
                              f" ({num_examples} examples): each step samples one of {p.groups} groups")
        return p.batch_size / (num_examples // p.groups)
    if p.batch_size > num_examples:
        raise ConfigError(f"batch_size={p.batch_size:g} is larger than the dataset ({num_examples} examples)")
    return p.batch_size / num_examples


def resolve_privacy(config: RunConfig, sample_rate: float, recorded: Mechanism | None = None) -> DPConfig | None:
    """The :class:`DPConfig` of a private run (``None`` for a non-private one). With
    ``target_epsilon``, sigma is the smallest noise multiplier whose epsilon over ``steps`` at
    ``delta`` is at most the target, by the same accountant the run reports with. Invalid
    privacy values raise :class:`privacy.errors.PrivacyError` naming them. ``recorded``: the
    mechanism a resumed run recorded (:func:`fsdpx.train.resume.recorded_mechanism`), used
    instead of optimising one when it is of the kind and size ``config`` asks for (a resume
    continues with it anyway: :func:`fsdpx.train.resume.continued_mechanism`)."""
    p = config.privacy
    if not p.private:
        return None
    mechanism = recorded if recorded is not None and same_choice(recorded, config) else run_mechanism(config)
    sigma = p.noise_multiplier
    accounting = dict(accountant=p.accountant, value_discretization_interval=p.accounting_interval)
    if sigma is None and mechanism.kind == "blt":  # one Gaussian at sigma / sens: no amplification claimed
        sigma = blt_noise_multiplier(p.target_epsilon, p.delta, mechanism, config.run.steps, **accounting)
    elif sigma is None:
        sigma = noise_multiplier(p.target_epsilon, p.delta, sample_rate, participations(config.run.steps, p.groups),
                                 **accounting)
    return DPConfig(clip_norm=p.clip_norm, noise_multiplier=sigma, sample_rate=sample_rate, delta=p.delta,
                    method=p.method, clipping=p.clipping, epsilon_budget=p.budget, accountant=p.accountant,
                    mechanism=mechanism)


def run_mechanism(config: RunConfig) -> Mechanism:
    """The run's noise mechanism: independent; the banded one whose ``bands`` coefficients
    minimise the prefix-sum error over the run's ``steps`` (:func:`privacy.mechanisms.optimal_banded`);
    or the BLT of ``buffers`` buffers minimising it at its sensitivity for participations
    ``min_separation`` apart (:func:`optimal_blt_mechanism`). A resume keeps the mechanism its run
    started with (:mod:`fsdpx.train.resume`)."""
    p = config.privacy
    if p.noise_mechanism == "blt":
        return optimal_blt_mechanism(p.buffers, config.run.steps, p.groups)
    return optimal_banded(p.bands, config.run.steps) if p.noise_mechanism == "banded" else INDEPENDENT


def same_choice(m: Mechanism, config: RunConfig) -> bool:
    """Whether ``m`` is of the kind and size ``config``'s flags choose (``--noise-mechanism``,
    ``--bands``, ``--buffers``, ``--min-separation``), whatever its coefficients."""
    p = config.privacy
    if m.kind != p.noise_mechanism:
        return False
    if m.kind == "blt":
        return len(m.decays) == p.buffers and m.min_sep == p.groups
    return m.kind != "banded" or m.bands == p.bands


BLT_ITERATIONS = 50
"""L-BFGS iterations of a run's BLT optimisation: on runs of 4 to 100 steps 50 reach the error 200
reach (the surplus iterations push decays towards 0 at a cost of seconds, changing nothing)."""


@functools.lru_cache(maxsize=8)
def optimal_blt_mechanism(buffers: int, steps: int, min_sep: int) -> Mechanism:
    """The BLT mechanism of ``buffers`` buffers that :func:`privacy.mechanisms.optimal_blt` finds
    for ``steps`` steps and ``ceil(steps / min_sep)`` participations ``min_sep`` apart, in
    :data:`BLT_ITERATIONS` L-BFGS iterations, computed
    once per process for these arguments (deterministic: every rank finds the same one). When it
    takes more than a second a line on stderr says what is being optimised, then how long it took."""
    said = threading.Event()

    def say() -> None:
        said.set()
        print(f"fsdpx train: optimising the BLT strategy ({buffers} buffers, {steps} steps, min separation"
              f" {min_sep})...", file=sys.stderr, flush=True)

    timer, start = threading.Timer(1.0, say), time.perf_counter()
    timer.daemon = True
    timer.start()
    try:
        found = optimal_blt(buffers, steps, participations=participations(steps, min_sep), min_sep=min_sep,
                            iterations=BLT_ITERATIONS)
    finally:
        timer.cancel()
    if said.is_set():
        print(f"fsdpx train: BLT strategy optimised in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return blt_mechanism(found, min_sep)


def sampler_of(config: RunConfig, num_examples: int, sample_rate: float) -> CyclicPoissonSampler:
    """The run's batch sampler: Poisson over the dataset (one group: ``PoissonSampler``'s bits),
    or over one of ``groups`` per step for a banded or BLT mechanism."""
    return CyclicPoissonSampler(num_examples, sample_rate, key=config.run.seed, groups=config.privacy.groups)


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
               *, num_examples: int, comm: Comm | None = None, parallel: Parallel | None = None,
               loss_fn: Callable[[Any, Tensor], Tensor] = token_loss,
               weights: Weights | None = None, read_log: ReadLog | None = None) -> tuple[TrainState, Step]:
    """The initial state and the step function of a run: the one place a step is chosen.

    Returns ``(state, step)`` with ``state.step == 0``. The accountant carries the run's delta,
    budget and PLD discretization, so the epsilon it reports is the one ``resolve_privacy``
    calibrated against. With ``comm`` (a sharded run) and its ``parallel`` (the run's layout
    resolved on ``model``, :func:`fsdpx.train.parallel.resolve_parallel`) the state is this
    rank's :class:`fsdpx.runtime.ShardedState` and the step takes the global batch.
    ``loss_fn(model output, targets) -> (B,)``: the source's
    (:attr:`fsdpx.train.sources.Source.loss_fn`). ``weights``: the pretrained weights of a
    sharded rank whose ``params`` are on ``meta`` (:func:`fsdpx.train.sources.read_mode`): each
    rank reads only the blocks it holds (:func:`rank_reader`), each one added to ``read_log``
    if given. ``config.run.precision`` "bf16":
    ``model``'s forward computes in bf16 from now on (:func:`privacy.precision.compute_in`), in
    every layout; the state stays fp32 (``tests/test_precision.py``)."""
    optimizer = make_optimizer(config, comm, resolve_sample_rate(config, num_examples),
                               plan=parallel.plan if parallel is not None else None)
    trainable = freezing(config, model, params)
    compute_in(model, config.run.precision)  # every layout's forward runs through the model's own forward
    p = config.privacy
    ledger = dp.mechanism.ledger_fields if dp is not None else {}
    accountant = Accountant(accountant=p.accountant, delta=p.delta, epsilon_budget=p.budget,
                            value_discretization_interval=p.accounting_interval, **ledger)
    seed = config.run.seed
    if comm is not None:
        if parallel is None:
            raise ValueError("a sharded step needs the run's resolved layout (parallel=resolve_parallel(...))")
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        step = make_sharded_step(model, loss_fn, optimizer, parallel.plan, comm, param_shapes=shapes, config=dp,
                                 num_examples=num_examples // p.groups, donate=True, trainable=trainable)
        read = rank_reader(model, params, weights, getattr(comm, "device", None), log=read_log)
        state = init_sharded(params, optimizer, parallel.plan, comm, key=seed, config=dp, read=read)
        return state._replace(accountant=accountant), step
    if dp is None:
        fresh = {k: v.clone() for k, v in params.items()}
        state = TrainState(fresh, optimizer.init(fresh), 0, seed, accountant)
        return state, make_plain_step(model, loss_fn, optimizer, trainable=trainable)
    state = init_state(params, optimizer, key=seed, config=dp)._replace(accountant=accountant)
    # the expected batch divides the noised sum: a group's (cyclic groups of a banded mechanism)
    return state, make_private_step(model, loss_fn, optimizer, dp, num_examples=num_examples // p.groups,
                                    donate=True, trainable=trainable)


def rank_reader(model: torch.nn.Module, params: dict[str, Tensor], weights: Weights | None,
                device: torch.device | None, *, log: ReadLog | None = None) -> Callable | None:
    """``init_sharded``'s ``read``: a block of a parameter read from ``weights`` (only its bytes,
    :func:`fsdpx.train.pretrained.read_block`), cast to the parameter's dtype, on ``device``, and
    added to ``log``; ``None`` when the parameters hold their values (no weights, or read whole)."""
    if weights is None or not any(p.is_meta for p in params.values()):
        return None
    names = file_names(model, weights)

    def read(name: str, box: Any, fused: tuple[int, int] | None) -> Tensor:
        block = read_block(weights, names[name], box, dtype=params[name].dtype, fused=fused)
        if log is not None:
            log.add(names[name], box)
        return block if device is None else block.to(device)

    return read


def make_optimizer(config: RunConfig, comm: Comm | None, sample_rate: float = 1.0, *,
                   plan: ShardingPlan | None = None) -> Optimizer:
    """The run's optimizer (``config.run.optimizer``: AdamW, or SGD with ``momentum``), wrapped by
    the configured offload. In a sharded run ZenFlow scores columns over
    the rows of every rank (one all-reduce of ``in`` floats per weight), so all ranks select
    what one unsharded run would; with tensor or pipeline parallelism (``plan``, the run's
    resolved layout) each weight by its own layout (``offload.layout_scores``: a row-parallel
    weight's scores also gathered over ``tp``, the top-k chosen on the whole vector, each rank
    keeping the chosen columns it holds; a pipeline stage's weights among its own ranks; the
    ``"auto"`` window rule's sums over every rank's blocks, ``offload.layout_stats``).
    ZenFlow's knobs (``config.offload``) are resolved by
    :mod:`offload.schedule`, an epoch being ``steps_per_epoch(sample_rate)`` steps; a
    combination it refuses is a :class:`ConfigError` naming the settings, raised before any
    step or file."""
    r = config.run
    inner = sgd(r.lr, r.momentum) if r.optimizer == "sgd" else adamw(r.lr)
    off = config.offload
    if off.kind == "zero":
        return offload.zero_offload(inner)
    if off.kind == "none":
        return inner
    combine, columns, views, stats = None, None, None, None
    layout = config.parallelism
    if comm is not None and plan is not None and (layout.tp > 1 or layout.pp > 1):
        stages = plan.pipeline.axis if plan.pipeline is not None else None
        combine, columns = offload.layout_scores(comm, offload.weight_layouts(plan), stage_axis=stages)
        views = offload.matrix_views(plan)
        stats = offload.layout_stats(comm, plan)
    elif comm is not None:
        rows = layout.data_parallel().opt_state(2).axes(0)  # the axes a weight's rows are split over
        combine = offload.sharded_scores(comm, rows) if rows else None
    try:
        epoch = offload.steps_per_epoch(sample_rate)
        select = offload.select_interval_steps(off.offload_select_strategy, off.offload_select_interval,
                                               off.offload_interval, epoch)
    except ValueError as err:
        raise ConfigError(f"offload_select_strategy {off.offload_select_strategy!r}: {err}") from None
    return offload.zenflow(inner, topk_ratio=off.offload_topk, update_interval=off.offload_interval,
                           select_interval=select, overlap=off.offload_overlap_step,
                           full_warm_up_rounds=off.offload_full_warm_up_rounds, combine_scores=combine,
                           local_columns=columns, matrices=views, combine_stats=stats,
                           host_process=off.offload_host_process, host_threads=off.offload_host_threads,
                           host_cores=off.host_cores())


def freezing(config: RunConfig, model: torch.nn.Module, params: dict[str, Tensor]) -> Freezing | None:
    """The run's freezing schedule (``config.run.freeze`` parsed, or under ``lora`` every base
    weight frozen from step 0), every name in it resolved against ``model``'s parameters now;
    ``None`` without one. Raises :class:`ConfigError` naming a name that matches no parameter,
    before any step or file."""
    if config.model.lora is not None:  # the base weights, frozen for the whole run
        from .lora_model import frozen_base

        return frozen_base(model)
    spec = config.run.freeze
    if not spec:
        return None
    schedule = Freezing.parse(spec)
    try:
        bind(schedule, model, params)  # resolves every name of the schedule
    except KeyError as err:
        raise ConfigError(f"freeze {spec!r}: {err.args[0]}") from None
    return schedule


def check_layout(config: RunConfig, world: int) -> Source:
    """Raise :class:`ConfigError` if the run's device is missing (:class:`DeviceUnavailableError`:
    ``cuda`` without a GPU for each of ``world`` processes), its model and data cannot be built,
    or its layout on ``world`` processes (a tp x pp that does not divide it, a pipeline schedule
    that cannot run the microbatches, a model without a tensor-parallel plan): checked once,
    before torchrun starts any process. Returns the source it built."""
    run_device(config.run.device, processes=world)  # cuda without a GPU for each process: refused now
    source = build_source(config, read="none")  # pretrained weights: keys checked, nothing read
    freezing(config, source.model, source.params)
    layout = config.parallelism
    resolve_parallel(layout, source.model, layout.mesh(world), source.inputs[:1])
    return source


def offload_metrics(state: Any) -> dict[str, float]:
    """The offload optimizer's last-step metrics (loop wait on the host, bytes each way), if any,
    as ``metrics.jsonl`` keys: ``offload_`` and the optimizer's name, its ``_s`` spelled
    ``_seconds`` like the file's other keys (``host_wait_s`` -> ``offload_host_wait_seconds``)."""
    opt = state.opt_state
    found = opt.get("metrics") if isinstance(opt, dict) else None
    unit = lambda k: k[:-2] + "_seconds" if k.endswith("_s") else k  # noqa: E731
    return {f"offload_{unit(k)}": v for k, v in found.items()} if found else {}


def new_read_log(source: Source) -> ReadLog | None:
    """An empty :class:`fsdpx.train.pretrained.ReadLog` of ``source``'s parameters in its
    pretrained file, for a rank that reads its blocks (parameters on ``meta``); ``None`` else."""
    if source.weights is None or not any(p.is_meta for p in source.params.values()):
        return None
    return ReadLog(source.weights, list(file_names(source.model, source.weights).values()))


def weights_read(log: ReadLog | None, comm: Comm) -> dict[str, Any] | None:
    """What each rank read of the pretrained file, gathered (every rank calls it: a collective
    when ``log`` is given): ``{"of": {"tensors", "bytes"}, "ranks": [{"tensors", "bytes"}, ...]}``
    in rank order, ``config.json``'s ``derived.weights_read``; ``None`` without a log."""
    if log is None:
        return None
    return {"of": {"tensors": log.of_tensors, "bytes": log.of_bytes}, "ranks": comm.all_gather_object(log.counts())}
