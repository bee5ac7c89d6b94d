"""Memory and communication of a sharding plan, derived from its layouts -- never hand-coded.

Every function takes a ``ShardingPlan`` or a ``Strategy`` (resolved on ``param_shapes``).
Memory reads ``local_box`` of each tensor's layout; communication is ``cost`` of the plans of
the transitions each parameter's layout performs (``ParamLayout.*_transitions``), listed by
``step_collectives`` in the order a runtime runs them. A runtime that executes ``step_collectives`` on a
``SimulatedMesh`` (or counts its real collectives the same way) must count exactly
``comm_per_step``.
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Mapping, NamedTuple, Sequence, Union

import torch

from .collectives import Collective, cost, plan
from .layout import local_shape
from .mesh import Mesh
from .spec import Spec
from .plan import ShardingPlan
from .strategies import Strategy

Shapes = Mapping[str, Sequence[int]]
PlanLike = Union[ShardingPlan, Strategy]


def as_plan(plan: PlanLike, param_shapes: Shapes) -> ShardingPlan:
    """``plan`` itself, or a strategy resolved on ``param_shapes`` (``Strategy.resolve``); a
    plan must cover exactly the parameters of ``param_shapes`` (``ValueError`` otherwise)."""
    if isinstance(plan, Strategy):
        return plan.resolve(param_shapes)
    if set(plan.params) != set(param_shapes):
        raise ValueError(f"the plan covers {sorted(set(plan.params) ^ set(param_shapes))} differently from"
                         " param_shapes")
    return plan

OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
"""Number of state tensors, each shaped like the parameter and of its dtype."""


class StepCollective(NamedTuple):
    """One collective of a train step: which phase, which parameter, what."""

    phase: str
    param: str
    collective: Collective


def _local_numel(shape: Sequence[int], spec: Spec, mesh: Mesh, rank: int) -> int:
    return math.prod(local_shape(tuple(shape), spec, mesh, rank))


HISTORY_DTYPE = torch.float64
"""The dtype of a correlated-noise mechanism's kept outputs (``privacy.mechanisms.correlated``)."""


def memory_by_rank(
    strategy: PlanLike, param_shapes: Shapes, mesh: Mesh, optimizer: str = "adamw", dtype: torch.dtype = torch.float32,
    *, history_copies: int = 0,
) -> list[int]:
    """Resident bytes per rank (index = rank) between steps: each parameter at
    ``param_at_rest``, its gradient at ``grad`` (reduced), and ``OPTIMIZER_STATES[optimizer]``
    state tensors at ``opt_state``, all of ``dtype``, unpadded; plus ``history_copies`` float64
    tensors at ``opt_state``: a correlated-noise mechanism's noise history, which each rank keeps
    for the block of noise it draws, its optimizer-state block (``len(privacy.mechanisms.
    empty_history(mechanism))``: ``bands - 1`` for a banded mechanism). Negative copies raise ``ValueError``. Equals the runtime's ``resident_bytes``
    metric (``tests/test_mechanisms_sharded.py::test_resident_bytes_count_the_noise_history``).

    Excludes everything transient: gathered parameters during compute (``peak_gathered_bytes``),
    the unreduced gradient of the unit being reduced, activations, communication buffers.

    Guarantees: uneven shards make ranks differ and rank 0 is never below another rank (it
    holds chunk 0, the largest); 0-d parameters count in full on every rank
    (``tests/test_cost_model.py``).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
    if history_copies < 0:
        raise ValueError(f"history_copies must be >= 0, got {history_copies}")
    states = OPTIMIZER_STATES[optimizer]
    plan = as_plan(strategy, param_shapes)
    out = [0] * mesh.size
    for lay in plan.params.values():
        for r in range(mesh.size):
            opt_numel = _local_numel(lay.shape, lay.opt_state, mesh, r)
            out[r] += (
                _local_numel(lay.shape, lay.at_rest, mesh, r)
                + _local_numel(lay.shape, lay.grad, mesh, r)
                + states * opt_numel
            ) * dtype.itemsize + history_copies * opt_numel * HISTORY_DTYPE.itemsize
    return out


def memory_per_rank(
    strategy: PlanLike, param_shapes: Shapes, mesh: Mesh, optimizer: str = "adamw", dtype: torch.dtype = torch.float32,
    *, history_copies: int = 0,
) -> int:
    """The worst rank's ``memory_by_rank``."""
    return max(memory_by_rank(strategy, param_shapes, mesh, optimizer, dtype, history_copies=history_copies))


def _check_units(units: Sequence[Sequence[str]], param_shapes: Shapes) -> None:
    seen: set[str] = set()
    for unit in units:
        for name in unit:
            if name not in param_shapes:
                raise ValueError(f"unit parameter {name!r} is not in param_shapes")
            if name in seen:
                raise ValueError(f"parameter {name!r} is in more than one unit")
            seen.add(name)
    missing = [n for n in param_shapes if n not in seen]
    if missing:
        raise ValueError(f"parameters in no unit: {missing}; every parameter belongs to exactly one unit")


def step_collectives(
    strategy: PlanLike,
    param_shapes: Shapes,
    mesh: Mesh,
    units: Sequence[Sequence[str]],
    dtype: torch.dtype = torch.float32,
    *,
    trainable: Collection[str] | None = None,
) -> list[StepCollective]:
    """Every collective of one train step, in execution order: forward (units in order),
    backward (units in reverse), then the update (parameters in unit order).

    ``trainable``: the parameters that train this step (``fsdpx.optim.Freezing``); a frozen one
    is still gathered for the forward and the backward but has no gradient to reduce and no
    update to move. ``None``: all of them.

    ``units`` partitions the parameters (each name exactly once, else ``ValueError``): a unit is
    what a runtime gathers and reduces together, e.g. one transformer block. Per parameter the
    collectives are ``plan``'s, so a runtime that flattens a unit into one buffer moves the same
    bytes as long as it pads per parameter as ``layout`` does (FSDP2 does).
    """
    _check_units(units, param_shapes)
    layouts = as_plan(strategy, param_shapes)
    out: list[StepCollective] = []

    def add(name: str, transitions: list) -> None:
        shape = layouts.params[name].shape
        for t in transitions:
            out.extend(StepCollective(t.phase, name, c) for c in plan(t.src, t.dst, shape, mesh, dtype))

    for unit in units:
        for name in unit:
            add(name, layouts.params[name].forward_transitions())
    trains = (lambda n: True) if trainable is None else set(trainable).__contains__
    for unit in reversed(units):
        for name in unit:
            moves = layouts.params[name].backward_transitions(layouts.reshard_after_forward)
            add(name, moves if trains(name) else [t for t in moves if t.phase != "reduce_grad"])
    for unit in units:
        for name in unit:
            if trains(name):
                add(name, layouts.params[name].update_transitions())
    return out


def comm_per_step(
    strategy: PlanLike,
    param_shapes: Shapes,
    mesh: Mesh,
    units: Sequence[Sequence[str]],
    dtype: torch.dtype = torch.float32,
    *,
    activations: Iterable[Collective] = (),
    trainable: Collection[str] | None = None,
) -> dict[str, int]:
    """Bytes per rank per train step: ``cost`` of ``step_collectives`` -- ``{kind: buffer_bytes}``
    plus ``send_bytes``/``recv_bytes`` (conventions in ``fsdpx.sharding.collectives``), for the rank
    holding the largest blocks (rank 0 under ``torch.chunk``). All-gathers and reduce-scatters
    move padded buffers, equal on every rank; with uneven shards, a rank with a smaller block
    all-reduces (and ``DistComm`` counts) its own smaller buffer
    (``tests/multiprocess/test_gloo.py::test_hsdp_on_four_gloo_ranks_equals_the_unsharded_run``).

    ``activations``: the step's activation collectives (tensor parallelism), which depend on the
    model's forward and are listed by ``fsdpx.runtime.activation_cost.activation_collectives``;
    their bytes are added. ``trainable``: as in ``step_collectives`` (frozen parameters move no
    gradient and no update; ``property_tests/test_freezing_properties.py``).

    Guarantees:
      * Running ``step_collectives`` on a ``SimulatedMesh`` counts exactly this dict
        (``tests/test_cost_model.py::test_simulating_a_train_step_counts_exactly_comm_per_step``).
      * Bytes depend on ``units`` only through validation: each parameter's plans are costed
        on their own (padded per parameter), so grouping does not change them.
      * Anchor (``test_fsdp2_anchor_49m_params_two_ranks``): zero3 on ``Mesh(dp=2)``, ~49M fp32
        params: all_gather ~391.3 MB (forward + backward), reduce_scatter ~195.7 MB; ddp:
        all_reduce ~195.7 MB.
    """
    params = [s.collective for s in step_collectives(strategy, param_shapes, mesh, units, dtype, trainable=trainable)]
    return cost([*params, *activations])


def peak_gathered_bytes(
    strategy: PlanLike,
    param_shapes: Shapes,
    mesh: Mesh,
    units: Sequence[Sequence[str]],
    dtype: torch.dtype = torch.float32,
) -> int:
    """Largest unit's parameters in their compute layout, counting only parameters whose compute
    layout differs from the at-rest one (the transient ``memory_per_rank`` leaves out), on the
    worst rank. 0 when nothing is gathered (ddp, zero1, zero2)."""
    _check_units(units, param_shapes)
    layouts = as_plan(strategy, param_shapes)
    peak = 0
    for unit in units:
        for r in range(mesh.size):
            total = 0
            for name in unit:
                lay = layouts.params[name]
                if lay.compute != lay.at_rest:
                    total += _local_numel(lay.shape, lay.compute, mesh, r)
            peak = max(peak, total * dtype.itemsize)
    return peak
