"""The sharded train step: one code path for every plan (DDP, ZeRO-1/2/3, HSDP, and tensor
parallelism composed with any of them), private or not.

Every rank runs ``step(state, batch)`` with its own ``Comm`` (threads of one process, or
``torch.distributed`` processes) on the same GLOBAL batch; it takes its own share (``torch.chunk``
of the batch over the plan's data axes: tensor-parallel ranks share theirs), and the plan's
per-parameter layouts (``fsdpx.sharding.plan``) decide every parameter collective:

1. forward and backward with per-unit gathers (``fsdpx.runtime.gather``) and, with tensor
   parallelism, the module styles' activation collectives (``fsdpx.runtime.tensor_parallel``);
   private: ghost clipping on this rank's examples (``privacy.clipping.clip_and_sum``: one
   backward, per-example norms need nothing beyond what the forward gathered; with tensor
   parallelism each rank's share of every squared norm is summed over ``tp`` by one all-reduce
   of ``B`` floats, replicated parameters counted on one rank);
2. per unit in reverse order: reduce the raw gradient (``plan(raw_grad, grad)``), bring it and
   the parameter to the optimizer-state layout;
3. private: add the noise of exactly the elements this rank updates,
   ``privacy.noise_slice`` over their global flat indices, so the sum of all ranks' noise is one
   unsharded draw (replicas draw identical bits); divide by ``q N`` (private) or the global
   batch size (plain);
4. the elementwise optimizer on the local slice, then back to the at-rest layout.

Guarantees: N sharded steps equal N unsharded steps (``make_private_step`` / ``make_plain_step``)
on the whole batch, for every strategy and mesh, float64 to rel 1e-10
(``property_tests/test_sharded_properties.py``, and with tensor parallelism
``property_tests/test_tensor_parallel_properties.py``); the bytes each step counts equal
``fsdpx.comm_per_step`` (``test_counted_bytes_equal_comm_per_step``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from typing import Any, Callable, Collection, NamedTuple

import torch
from torch import Tensor, nn

from ckpt.flatten import register_type
from fsdpx.optim import Optimizer, update_fn
from fsdpx.optim.freezing import Freezing, Trainable, TrainableSets, bind, update_trainable
from fsdpx.sharding.collectives import cached_plan as plan_collectives
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import chunk_bounds, local_box
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.spec import Spec
from fsdpx.sharding.cost_model import PlanLike, as_plan
from fsdpx.sharding.pipeline import rank_plan
from fsdpx.sharding.plan import ShardingPlan
from privacy.accounting import Accountant
from privacy.batch import call_model, first_tensor, real_count, slice_batch, unpack
from privacy.clipping import ShardedNorms, clip_and_sum
from privacy.noise import BLOCK, noise_slice
from privacy.step import DPConfig, check_budget
from privacy.tape import LossFn
from privacy.validate import check_model

from .gather import Gatherer, cached_local_shape
from .replicas import ReplicaCheck
from .tensor_parallel import TensorParallelHooks
from .units import Unit, make_units

Params = dict[str, Tensor]


class ShardedState(NamedTuple):
    """One rank's share of the train state."""

    params: Params  # at-rest layout
    opt_state: Any  # the optimizer's state over the opt_state layout
    step: int
    key: int
    accountant: Accountant | None


# ckpt stores states without pickle, by registered type; it sits below the runtime, so the
# runtime registers its own state type.
register_type("ShardedState", ShardedState, lambda s: dict(s._asdict()), lambda d: ShardedState(**d))


def local_block(t: Tensor, spec: Spec, mesh: Mesh, rank: int) -> Tensor:
    """A contiguous copy of the block of global tensor ``t`` that ``rank`` holds under ``spec``."""
    box = local_box(tuple(t.shape), spec, mesh, rank)
    return t[tuple(slice(a, b) for a, b in box)].clone()


def init_sharded(params: Params, optimizer: Optimizer, strategy: PlanLike, comm: Comm, *, key: int,
                 config: DPConfig | None = None) -> ShardedState:
    """This rank's state before step 0, cut from the full ``params`` (every rank passes the same
    full values): parameters at rest, optimizer state initialised on the opt_state layout, each
    in the plan's (view) shape. ``strategy``: a ``Strategy`` or a resolved ``ShardingPlan``; with
    a pipeline, only the parameters of this rank's stages (``fsdpx.sharding.pipeline.rank_plan``)."""
    mesh, rank = comm.mesh, comm.rank
    plan = rank_plan(as_plan(strategy, {n: tuple(p.shape) for n, p in params.items()}), mesh, rank)
    views = {n: params[n].detach().reshape(lay.shape) for n, lay in plan.params.items()}
    at_rest = {n: local_block(v, plan.params[n].at_rest, mesh, rank) for n, v in views.items()}
    at_opt = {n: local_block(v, plan.params[n].opt_state, mesh, rank) for n, v in views.items()}
    accountant = None
    if config is not None:
        accountant = Accountant(accountant=config.accountant, delta=config.delta, epsilon_budget=config.epsilon_budget)
    return ShardedState(at_rest, optimizer.init(at_opt), 0, key, accountant)


def flat_runs(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The global flat index ranges ``[start, stop)`` of ``box`` in row-major order, merged
    where contiguous (one range for a dim-0 shard)."""
    if any(a >= b for a, b in box):
        return []
    if not shape:
        return [(0, 1)]
    inner = math.prod(shape[1:])
    if all(box[d] == (0, shape[d]) for d in range(1, len(shape))):
        return [(box[0][0] * inner, box[0][1] * inner)]
    runs = []
    for i in range(*box[0]):
        runs += [(i * inner + a, i * inner + b) for a, b in flat_runs(shape[1:], box[1:])]
    return runs


def shard_noise(name: str, shape: tuple[int, ...], box, *, key: int, step: int, std: float, dtype,
                device: torch.device | str = "cpu") -> Tensor:
    """The unsharded run's noise for the elements of ``box`` of parameter ``name``, shaped like
    the box: ``noise_slice`` of each of the box's flat runs, concatenated, on ``device``. It is
    drawn on the host (the sampler is a CPU kernel) and copied: the same bits on any device.

    Runs closer than ``privacy.noise.BLOCK`` are drawn as one covering slice and cut out of it
    (partition invariance makes the bits the same): a column block of a row-parallel weight is
    one short run per row, and drawing each alone would restart its noise block every time, up
    to ``BLOCK`` draws per run; covering costs at most the gaps, never more than the parameter
    (``tests/test_runtime.py::test_shard_noise_equals_the_unsharded_draw_of_its_box``)."""
    numel = math.prod(shape)
    parts = []
    for lo, hi, runs in _clusters(flat_runs(shape, box), BLOCK):
        drawn = noise_slice(name, numel, lo, hi, key=key, step=step, std=std, dtype=dtype)
        parts += [drawn] if len(runs) == 1 else [drawn[a - lo:b - lo] for a, b in runs]
    size = tuple(b - a for a, b in box)
    if not parts:
        return torch.zeros(size, dtype=dtype, device=device)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).view(size).to(device)


def _clusters(runs: list[tuple[int, int]], gap: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Consecutive ``runs`` grouped while the space between them is at most ``gap``: each group
    as ``(first start, last stop, its runs)``."""
    out: list[tuple[int, int, list[tuple[int, int]]]] = []
    for a, b in runs:
        if out and a - out[-1][1] <= gap:
            lo, _, members = out[-1]
            members.append((a, b))
            out[-1] = (lo, b, members)
        else:
            out.append((a, b, [(a, b)]))
    return out


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


def trainable_update(optimizer: Optimizer, donate: bool, sets: TrainableSets | None) -> Callable:
    """The step's update: ``fsdpx.optim.update_fn``, through ``update_trainable`` under a
    freezing schedule (per-parameter counts from the first step on, frozen ones untouched)."""
    update = update_fn(optimizer, donate=donate)
    return update if sets is None else functools.partial(update_trainable, update)


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
) -> Callable[[ShardedState, tuple[Any, Tensor]], tuple[ShardedState, dict[str, Any]]]:
    """Returns this rank's ``step(state, global_batch) -> (state, metrics)`` (pure from the
    caller's view: ``state`` is not modified). ``strategy`` is a ``Strategy`` or a resolved
    ``ShardingPlan`` (``fsdpx.sharding.tensor_parallel.resolve`` for tensor parallelism);
    ``param_shapes`` are the parameters' own shapes. ``config`` makes it private (ghost clipping
    with ``config.method`` "ghost" or "auto", noise, accounting; ``num_examples`` then
    required).

    Metrics: loss (global mean), batch_size (global), comm (bytes per collective kind moved by
    this step), resident_bytes (this rank's parameters at rest + reduced gradients + optimizer
    state, to compare with ``fsdpx.memory_by_rank``), and for private runs clipped_fraction,
    mean_norm. All but comm (ThreadComm: rank 0's; DistComm: this rank's) and resident_bytes
    are identical on every rank.
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
    (``property_tests/test_freezing_properties.py``)."""
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
    if plan.pipeline is not None:
        return _pipelined(model, loss_fn, optimizer, plan, comm, config, num_examples, donate, sets)
    units = make_units(model, param_shapes, unit_modules)
    keep = config is not None and needs_fallback(model, param_shapes)
    tensor_parallel = TensorParallelHooks(model, plan, comm)
    norms = sharded_norms(plan, comm) if config is not None else None
    replicas = ReplicaCheck(plan, comm, model)
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
        local = _my_share(batch, plan, comm)
        gatherer = Gatherer(model, units, plan, comm, state.params, keep_after_backward=keep, trainable=names)
        raw, stats = _local_grads(model, loss_fn, gatherer, tensor_parallel, local, config, norms)
        gatherer.finish()
        update = trainable_update(optimizer, donate, sets)
        new_params, opt_state, resident = _reduce_and_update(raw, state, plan, comm, units, update,
                                                             _divisor(batch, config, num_examples),
                                                             _owned_noise(state, plan, comm, config, names)
                                                             if config else None, names, replicas)
        metrics = _global_metrics(comm, stats, config)
        metrics["comm"] = {k: v - before.get(k, 0) for k, v in comm.counts().items()}
        metrics["resident_bytes"] = resident
        accountant = state.accountant.record(config.noise_multiplier, config.sample_rate) if config else (
            None if state.accountant is None else state.accountant.record(0.0, 1.0))  # plain: epsilon inf, as unsharded
        return ShardedState(new_params, opt_state, state.step + 1, state.key, accountant), metrics

    return step


def _pipelined(model, loss_fn, optimizer, plan, comm, config, num_examples, donate, sets=None):
    """The step of a plan with a pipeline (``fsdpx.runtime.pipeline``), agreement checked first."""
    from .pipeline import PipelineStep

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


def sharded_norms(plan: ShardingPlan, comm: Comm) -> ShardedNorms | None:
    """With tensor parallelism, how this rank's share of each example's squared norm becomes
    the whole: parameters split over ``tp`` count on every rank (their blocks are disjoint),
    replicated ones on the rank with ``tp`` index 0 only; one all-reduce of the ``[B]`` squared
    norms over the rank's ``tp`` group completes them. Parameters whose raw gradient is partial
    over ``tp`` (sequence parallelism: each rank saw a chunk of the sequence) first have their
    per-example gradients summed over the group, one all-reduce of ``[B, their elements]``.
    ``None`` without tensor parallelism."""
    axis = plan.tp_axis
    if axis is None or comm.mesh.axis_size(axis) == 1:
        return None
    first = comm.mesh.index(comm.rank, axis) == 0
    counted = frozenset(n for n, lay in plan.params.items() if axis in lay.compute.sharding_axes or first)
    partial = frozenset(n for n, lay in plan.params.items() if axis in lay.raw_grad.partial)
    sub = comm.mesh.sub(axis)

    def all_reduce(t: Tensor) -> Tensor:
        src = Spec.replicated(t.dim())
        (c,) = plan_collectives(src.with_partial((axis,)), src, tuple(t.shape), sub, t.dtype)
        return comm.run(c, t.contiguous())

    return ShardedNorms(counted, all_reduce, partial)


def needs_fallback(model: nn.Module, trainable) -> bool:
    """True if a module owning a trainable parameter has no ghost rule: its per-module vmap
    reads the gathered parameters after the backward, so they must stay gathered until then."""
    from privacy.layers import rule_for
    from privacy.tape import owners

    modules = dict(model.named_modules())
    return any(rule_for(modules[m]) is None for m in owners(model, dict.fromkeys(trainable)))


def _my_share(batch: tuple, plan: ShardingPlan, comm: Comm) -> tuple:
    """This rank's rows of the global ``batch`` (``privacy.batch.slice_batch``: every tensor
    leading with the batch dimension is cut, mapping inputs and a padding mask included, the
    rest shared): chunk ``i`` of ``k`` over the plan's data axes."""
    k = comm.mesh.axis_size(plan.data_axes)
    i = comm.mesh.index(comm.rank, plan.data_axes)
    a, b = chunk_bounds(unpack(batch)[1].shape[0], k, i)
    return slice_batch(batch, a, b)


def _divisor(batch: tuple, config: DPConfig | None, num_examples: int | None) -> float:
    """``q N`` (private), or the global number of real examples (plain)."""
    if config is not None:
        return config.sample_rate * num_examples
    return float(max(real_count(batch), 1))


def masked_losses(losses: Tensor, mask: Tensor | None) -> Tensor:
    """``losses`` with padding rows (mask False) set to exactly 0, so their gradient is 0."""
    return losses if mask is None else torch.where(mask, losses, torch.zeros_like(losses))


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
        return zeros, (0.0, 0, 0, 0.0)
    n = real_count(batch)
    seq_dim = tensor_parallel.seq_dim
    seq_len = first_tensor(inputs).shape[seq_dim] if seq_dim is not None else 0
    with gatherer.installed(), tensor_parallel.installed(seq_len):
        if config is None:
            losses = masked_losses(loss_fn(call_model(model, inputs), targets), mask)
            names = list(gatherer.full_view())  # this step's trainable parameters
            grads = torch.autograd.grad(losses.sum(), [gatherer.full[p] for p in names], allow_unused=True)
            raw = {p: g if g is not None else torch.zeros_like(gatherer.full[p]) for p, g in zip(names, grads)}
            stats = (float(losses.detach().sum()), n, 0, 0.0)
        else:
            result = clip_and_sum(model, gatherer.full_view(), batch, loss_fn, clip_norm=config.clip_norm,
                                  method=config.method, clipping=config.clipping, nonfinite=config.nonfinite,
                                  run_model=lambda x: call_model(model, x), sharded_norms=norms, lazy=True)
            raw = result.grads  # each sum formed when the reduction takes it, then freed
            clipped = int((result.norms > config.clip_norm).sum())
            stats = (float(result.losses.sum()), n, clipped, float(result.norms.sum()))
    return raw, stats


def _owned_noise(state: ShardedState, plan: ShardingPlan, comm: Comm, config: DPConfig,
                 trainable: Collection[str] | None = None) -> "OwnedNoise":
    """The noise of the elements this rank updates (its optimizer-state block of each
    parameter), drawn when the reduction takes it (:class:`OwnedNoise`)."""
    return OwnedNoise(state, plan, comm, config, trainable)


class OwnedNoise:
    """Each parameter's noise on the elements this rank updates (its optimizer-state block):
    the unsharded run's draw for exactly those global indices (a fused view keeps the
    parameter's flat order, so the indices are the parameter's own). Drawn by :meth:`pop`, when
    the reduction adds it, so one parameter's noise is alive at a time, never the whole model's
    (a full gradient's worth under DDP). The bits do not depend on the order of the draws: each
    is a pure function of (key, step, name, index). Only the ``trainable`` ones exist when a
    freezing schedule gives them: a frozen parameter gets none (``pop`` raises ``KeyError``),
    and the others' bits are the same (noise is per parameter name)."""

    def __init__(self, state: ShardedState, plan: ShardingPlan, comm: Comm, config: DPConfig,
                 trainable: Collection[str] | None = None):
        self.state, self.plan, self.comm, self.config = state, plan, comm, config
        self.names = frozenset(plan.params if trainable is None else (n for n in plan.params if n in trainable))

    def pop(self, name: str) -> Tensor:
        if name not in self.names:
            raise KeyError(f"no noise for {name!r}: not a trainable parameter of this step")
        lay = self.plan.params[name]
        box = local_box(lay.shape, lay.opt_state, self.comm.mesh, self.comm.rank)
        held = self.state.params[name]
        return shard_noise(name, lay.shape, box, key=self.state.key, step=self.state.step,
                           std=self.config.noise_std, dtype=held.dtype, device=held.device)


def _reduce_and_update(raw: Params, state: ShardedState, plan: ShardingPlan, comm: Comm, units: list[Unit],
                       update: Callable, divisor: float, noise: OwnedNoise | None,
                       trainable: Collection[str] | None = None, replicas: ReplicaCheck | None = None):
    """Reduce, noise and update. ``trainable`` (a freezing schedule's set of this step): the
    other parameters move nothing (no reduce, no noise, no update, no return to rest: their
    at-rest block is unchanged; ``fsdpx.comm_per_step(..., trainable=)`` counts exactly this)
    and keep their tensors and optimizer state; ``update`` is then an
    ``fsdpx.optim.update_trainable`` one, which returns them untouched. ``replicas`` (the first
    step's ``ReplicaCheck``) sees every reduced gradient, and compares before the update."""
    mesh = comm.mesh
    trains = (lambda n: True) if trainable is None else frozenset(trainable).__contains__
    grads_upd, params_upd = {}, {}
    grad_bytes = 0
    for unit in reversed(units):
        for name in unit.params:
            g = raw.pop(name, None) if trains(name) else None  # formed (if lazy) and freed once reduced
            if g is None:  # frozen: no gradient
                continue
            lay = plan.params[name]
            g = g.reshape(cached_local_shape(lay.shape, lay.compute, mesh, comm.rank))  # the layout's view
            g = _run_plan(comm, plan_collectives(lay.raw_grad, lay.grad, lay.shape, mesh, g.dtype), g)
            if replicas is not None:
                replicas.add(plan, name, g)
            grad_bytes += g.numel() * g.element_size()
            g = _run_plan(comm, plan_collectives(lay.grad, lay.opt_state, lay.shape, mesh, g.dtype), g)
            if noise is not None:
                g = g + noise.pop(name)  # drawn now: one parameter's noise alive at a time
            grads_upd[name] = g / divisor
            p = state.params[name]
            params_upd[name] = _run_plan(comm, plan_collectives(lay.at_rest, lay.opt_state, lay.shape, mesh, p.dtype), p)
    if replicas is not None:
        replicas.finish()  # a plan that does not fit the model stops here, before anything changes
    order = list(state.params)
    # a frozen parameter goes in at rest, as it is: update_trainable hands it back untouched
    new_upd, opt_state = update({n: grads_upd[n] for n in order if n in grads_upd}, state.opt_state,
                                {n: params_upd.get(n, state.params[n]) for n in order})
    new_params = {}
    for name in order:
        lay = plan.params[name]
        new_params[name] = state.params[name] if name not in grads_upd else _run_plan(
            comm, plan_collectives(lay.opt_state, lay.at_rest, lay.shape, mesh, new_upd[name].dtype), new_upd[name])
    resident = grad_bytes + _tensor_bytes(new_params) + _tensor_bytes(opt_state)
    return new_params, opt_state, resident


def _tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested structure of dicts, lists and tuples."""
    if isinstance(tree, Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _run_plan(comm: Comm, collectives, x: Tensor) -> Tensor:
    for c in collectives:
        x = comm.run(c, x)
    return x


def _global_metrics(comm: Comm, stats, config: DPConfig | None) -> dict[str, Any]:
    """The step's metrics over every rank from each rank's ``stats`` (loss sum, examples,
    clipped examples, norm sum): summed in rank order, the same floats whichever way they
    travel (``all_gather_floats`` where the communicator has it: one float64 all-gather)."""
    floats = getattr(comm, "all_gather_floats", None)
    everyone = floats(stats) if floats is not None else comm.all_gather_object(stats)
    loss = sum(s[0] for s in everyone)
    n = int(sum(s[1] for s in everyone))
    metrics: dict[str, Any] = {"loss": loss / n if n else float("nan"), "batch_size": n}
    if config is not None:
        metrics["clipped_fraction"] = sum(s[2] for s in everyone) / n if n else 0.0
        metrics["mean_norm"] = sum(s[3] for s in everyone) / n if n else 0.0
    return metrics
