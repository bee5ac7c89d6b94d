"""The sharded train step: one code path for every plan (DDP, ZeRO-1/2/3, HSDP, and tensor
parallelism composed with any of them), private or not.

Every rank runs ``step(state, batch)`` with its own ``Comm`` (threads of one process, or
``torch.distributed`` processes) on the same GLOBAL batch; it takes its own share (``torch.chunk``
of the batch over the plan's data axes: tensor-parallel ranks share theirs;
``fsdpx.runtime.global_batch``), and the plan's per-parameter layouts (``fsdpx.sharding.plan``)
decide every parameter collective (``state``: this rank's ``ShardedState``,
``fsdpx.runtime.sharded_state``):

1. forward and backward with per-unit gathers (``fsdpx.runtime.gather``) and, with tensor
   parallelism, the module styles' activation collectives (``fsdpx.runtime.tensor_parallel``);
   private: ghost clipping on this rank's examples (``privacy.clipping.clip_and_sum``: one
   backward, per-example norms need nothing beyond what the forward gathered; with tensor
   parallelism each rank's share of every squared norm is summed over ``tp`` by one all-reduce
   of ``B`` floats, replicated parameters counted on one rank; ``fsdpx.runtime.sharded_clipping``);
2. per unit in reverse order: reduce the raw gradient (``plan(raw_grad, grad)``), bring it and
   the parameter to the optimizer-state layout (steps 2-4: ``fsdpx.runtime.reduce``);
3. private: add the noise of exactly the elements this rank updates,
   ``privacy.noise_slice`` over their global flat indices, so the sum of all ranks' noise is one
   unsharded draw (replicas draw identical bits; ``fsdpx.runtime.owned_noise``); divide by
   ``q N`` (private) or the global batch size (plain);
4. the elementwise optimizer on the local slice, then back to the at-rest layout.

Guarantees: N sharded steps equal N unsharded steps (``make_private_step`` / ``make_plain_step``)
on the whole batch, for every strategy and mesh, float64 to rel 1e-10
(``property_tests/test_sharded_properties.py``, and with tensor parallelism
``property_tests/test_tensor_parallel_properties.py``); the bytes each step counts equal
``fsdpx.comm_per_step`` (``test_counted_bytes_equal_comm_per_step``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Collection

import torch
from torch import Tensor, nn

from fsdpx.optim import Optimizer
from fsdpx.optim.freezing import Freezing, Trainable, TrainableSets, bind
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.cost_model import PlanLike, as_plan
from fsdpx.sharding.plan import ShardingPlan
from privacy.batch import call_model, first_tensor, real_count, unpack
from privacy.clipping import ShardedNorms, clip_and_sum
from privacy.step import DPConfig, check_budget
from privacy.tape import LossFn
from privacy.validate import check_model

from .gather import Gatherer
from .global_batch import NO_STATS, counts_its_share, device_stats, global_metrics, masked_losses, my_share
from .owned_noise import OwnedNoise
from .pipeline import PipelineStep
from .reduce import gradient_divisor, reduce_and_update, tensor_bytes, trainable_update
from .replicas import ReplicaCheck
from .sharded_clipping import needs_fallback, sharded_norms
from .sharded_state import ShardedState
from .tensor_parallel import TensorParallelHooks
from .units import Unit, make_units


def config_digest(plan: ShardingPlan, dtypes: dict[str, torch.dtype], config: DPConfig | None,
                  units: list[Unit], *, exclude_rank_local: bool = False) -> str:
    """A hash every rank compares at start: plan (layouts, styles), mesh, parameter shapes and
    dtypes, units and privacy config must agree. ``exclude_rank_local``: leave out what differs
    by rank by design (a pipeline rank holds only its stages' parameters and units)."""
    blob = json.dumps({
        "plan": repr(plan),
        "params": {n: [list(lay.shape)] + ([] if exclude_rank_local else [str(dtypes[n])])
                   for n, lay in plan.params.items()},
        "units": [] if exclude_rank_local else [[u.module, list(u.params)] for u in units],
        "private": repr(config),
    }, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def check_agreement(comm: Comm, digest: str) -> None:
    """Raise naming the ranks whose configuration differs from rank 0's."""
    digests = comm.all_gather_object(digest)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise ValueError(f"ranks {bad} disagree with rank 0 on the strategy, mesh, model or privacy config")


def schedule_digest(sets: TrainableSets | None, names: Collection[str] | None) -> str:
    """What ranks compare of a freezing schedule at the first step: a ``Freezing``'s data, or a
    callable's set at that step ("" without a schedule)."""
    if sets is None:
        return ""
    what = [(s, sorted(n)) for s, n in sets.schedule.changes] if isinstance(sets.schedule, Freezing) else sorted(names)
    return hashlib.blake2b(json.dumps(what).encode(), digest_size=16).hexdigest()


def make_sharded_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    strategy: PlanLike,
    comm: Comm,
    *,
    param_shapes: dict[str, tuple[int, ...]],
    config: DPConfig | None = None,
    num_examples: int | None = None,
    unit_modules: list[str] | None = None,
    donate: bool = False,
    trainable: Trainable | None = None,
    local_batch: bool = False,
) -> Callable[[ShardedState, tuple[Any, Tensor]], tuple[ShardedState, dict[str, Any]]]:
    """Returns this rank's ``step(state, global_batch) -> (state, metrics)`` (pure from the
    caller's view: ``state`` is not modified). ``strategy`` is a ``Strategy`` or a resolved
    ``ShardingPlan`` (``fsdpx.sharding.tensor_parallel.resolve`` for tensor parallelism);
    ``param_shapes`` are the parameters' own shapes. ``config`` makes it private (ghost clipping
    with ``config.method`` "ghost" or "auto", noise, accounting; ``num_examples`` then
    required).

    Metrics: loss (global mean), batch_size (the global batch's real examples, each counted
    once on every layout: ``tests/test_step_metrics.py``), comm_bytes (bytes per collective
    kind moved by this step), resident_bytes (this rank's parameters at rest + reduced
    gradients + optimizer state + a banded mechanism's noise history; without it, to compare with
    ``fsdpx.memory_by_rank``), and for private
    runs clipped_fraction, mean_norm. All but comm_bytes (ThreadComm: rank 0's; DistComm: this
    rank's) and resident_bytes are identical on every rank.
    ``donate=True`` (JAX's ``donate_argnums``): the caller gives up ``state``; its tensors may be
    overwritten by the update (``optimizer.update_inplace`` when the optimizer has one). Same
    bits as ``donate=False`` (``property_tests/test_sharded_properties.py::
    test_donated_state_gives_the_same_bits``); saves an allocation and a pass per tensor.
    Raises ``ValueError`` if the mesh lacks the plan's data axes, or (at the first step) if
    ranks disagree on the configuration.

    ``trainable`` (``fsdpx.optim.Freezing``, or a callable ``step -> names``; names resolve
    against ``param_shapes``, aliases and module prefixes included) changes which parameters
    train, step by step; every rank computes the same set from the step alone (a ``Freezing``
    is compared across ranks at the first step with the rest of the configuration; a callable,
    by its set at that step). A frozen parameter is still gathered for the forward and the
    backward, but its leaf needs no gradient, and it moves nothing else: no gradient reduce, no
    noise, no update, no return to rest; its at-rest block and optimizer state keep their
    tensors (``fsdpx.optim.update_trainable``: per-parameter counts). The bytes moved equal
    ``fsdpx.comm_per_step(..., trainable=<the step's set>)``. Guarantee: N steps under a
    schedule equal the unsharded steps under it, float64 to rel 1e-10, and the private noise of
    a trainable parameter is the same bits whatever else is frozen
    (``property_tests/test_freezing_properties.py``).

    ``local_batch=True``: each rank passes its OWN rows, not the global batch (a torchrun job
    whose ranks load their own shares: ``fsdpx.runtime.opacus_fsdp``); the step is the global
    batch's step, that batch being the union of the ranks' rows in rank order (the metrics
    count every rank's rows). Only for a private step (its divisor ``q N`` does not depend on
    the rows) on a plan that splits the data over every rank (no tensor or pipeline
    parallelism): ``ValueError`` otherwise."""
    mesh = comm.mesh
    plan = as_plan(strategy, param_shapes)
    for axis in plan.data_axes:
        if axis not in mesh.axis_names:
            raise ValueError(f"strategy {plan.name} splits data over axis {axis!r}, not in {mesh}")
    if config is not None and (num_examples is None or config.method == "vmap"):
        raise ValueError("a private sharded step needs num_examples and method 'ghost' or 'auto'")
    if config is not None:
        check_model(model)  # a layer that mixes examples is named before any step
    sets = bind(trainable, model, plan.params)  # a Freezing naming no parameter fails here
    if local_batch and (config is None or plan.pipeline is not None or plan.tp_axis is not None):
        raise ValueError("local_batch=True needs a private step on a plan without tensor or pipeline parallelism")
    if plan.pipeline is not None:
        return _pipelined(model, loss_fn, optimizer, plan, comm, config, num_examples, donate, sets)
    units = make_units(model, param_shapes, unit_modules)
    keep = config is not None and needs_fallback(model, param_shapes)
    tensor_parallel = TensorParallelHooks(model, plan, comm)
    norms = sharded_norms(plan, comm) if config is not None else None
    replicas = ReplicaCheck(plan, comm, model)
    counts = counts_its_share(plan, comm)
    agreed: list[bool] = []

    def step(state: ShardedState, batch: tuple) -> tuple[ShardedState, dict[str, Any]]:
        names = sets(state.step) if sets is not None else None
        if not agreed:
            dtypes = {n: t.dtype for n, t in state.params.items()}
            check_agreement(comm, config_digest(plan, dtypes, config, units) + schedule_digest(sets, names))
            agreed.append(True)
        if config is not None:
            check_budget(state.accountant, config)
        before = comm.counts()
        local = batch if local_batch else my_share(batch, plan, comm)
        gatherer = Gatherer(model, units, plan, comm, state.params, keep_after_backward=keep, trainable=names)
        raw, stats = _local_grads(model, loss_fn, gatherer, tensor_parallel, local, config, norms)
        gatherer.finish()
        update = trainable_update(optimizer, donate, sets)
        noise = OwnedNoise(state, plan, comm, config, names) if config else None
        new_params, opt_state, resident = reduce_and_update(raw, state, plan, comm, units, update,
                                                            gradient_divisor(batch, config, num_examples),
                                                            noise, names, replicas)
        metrics = global_metrics(comm, stats if counts else NO_STATS, config)
        metrics["comm_bytes"] = {k: v - before.get(k, 0) for k, v in comm.counts().items()}
        accountant = state.accountant.record(config.noise_multiplier, config.sample_rate) if config else (
            None if state.accountant is None else state.accountant.record(0.0, 1.0))  # plain: epsilon inf, as unsharded
        history = noise.history() if noise is not None else state.noise_history
        metrics["resident_bytes"] = resident + tensor_bytes(history)  # a banded mechanism's past outputs too
        return ShardedState(new_params, opt_state, state.step + 1, state.key, accountant, history), metrics

    return step


def _pipelined(model, loss_fn, optimizer, plan, comm, config, num_examples, donate, sets=None):
    """The step of a plan with a pipeline (``fsdpx.runtime.pipeline``), agreement checked first."""
    run = PipelineStep(model, loss_fn, optimizer, plan, comm, config=config, num_examples=num_examples, donate=donate,
                       trainable=sets)
    agreed: list[bool] = []

    def step(state: ShardedState, batch: tuple[Any, Tensor]) -> tuple[ShardedState, dict[str, Any]]:
        if not agreed:
            names = sets(state.step) if sets is not None else None
            check_agreement(comm, config_digest(plan, {}, config, [], exclude_rank_local=True)
                            + schedule_digest(sets, names))
            agreed.append(True)
        return run(state, batch)

    return step


def _local_grads(model, loss_fn, gatherer: Gatherer, tensor_parallel: TensorParallelHooks, batch,
                 config: DPConfig | None, norms: ShardedNorms | None):
    """Raw (unreduced, compute-layout) gradient sums over this rank's examples, shaped as the
    parameters (the reduction views them in each layout's shape), and stats (over the real
    examples: padding rows add nothing). Private: a ``ClippedSums`` whose sums are formed as
    the reduction pops them, after the gatherer has released every unit (the sums read only
    the tape's factors), so neither the gathered parameters nor all full-size sums are ever
    held together."""
    inputs, targets, mask = unpack(batch)
    if targets.shape[0] == 0:
        # every rank of a tensor-parallel group shares the (empty) batch: the group skips its
        # activation collectives together, and the parameter collectives still run in order
        gatherer.dry_run()
        zeros = {name: torch.zeros_like(gatherer.full[name]) for name in gatherer.plans}
        return zeros, NO_STATS
    n = real_count(batch)
    seq_dim = tensor_parallel.seq_dim
    seq_len = first_tensor(inputs).shape[seq_dim] if seq_dim is not None else 0
    with gatherer.installed(), tensor_parallel.installed(seq_len):
        if config is None:
            losses = masked_losses(loss_fn(call_model(model, inputs), targets), mask)
            names = list(gatherer.full_view())  # this step's trainable parameters
            grads = torch.autograd.grad(losses.sum(), [gatherer.full[p] for p in names], allow_unused=True)
            raw = {p: g if g is not None else torch.zeros_like(gatherer.full[p]) for p, g in zip(names, grads)}
            stats = device_stats(losses.detach().sum(), n)
        else:
            result = clip_and_sum(model, gatherer.full_view(), batch, loss_fn, clip_norm=config.clip_norm,
                                  method=config.method, clipping=config.clipping, nonfinite=config.nonfinite,
                                  run_model=lambda x: call_model(model, x), sharded_norms=norms, lazy=True)
            raw = result.grads  # each sum formed when the reduction takes it, then freed
            stats = device_stats(result.losses.sum(), n, (result.norms > config.clip_norm).sum(), result.norms.sum())
    return raw, stats
