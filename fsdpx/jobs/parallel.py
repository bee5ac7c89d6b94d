"""Tensor, pipeline and 3-D parallel plans of a job: which degrees fit ``n`` devices, the memory
per rank and the bytes a rank sends (pure: the model on the meta device, ``fsdpx.sharding``'s
cost model).

A technique's degrees are a :class:`fsdpx.train.layout.Layout`, the value ``fsdpx train
--strategy S --tp T --pp P --schedule K --microbatches M --virtual-stages V`` builds: ``n = dp x
tp x pp`` ranks (``Layout.mesh``), the data-parallel ``strategy`` over the ``dp`` axis.
:func:`plan_of` resolves it on the job's model exactly as the run will
(``fsdpx.train.parallel.resolve_parallel``), so degrees the model cannot take (heads that do not
divide by ``tp``, fewer blocks than stages, no tensor-parallel plan, no block list) are found
here, before anything runs.

Memory (:func:`memory`), on the worst rank: the resolved plan's state at rest on that rank
(``memory_by_rank`` of ``rank_plan``: only its stages' parameters), its largest gathered unit,
and activations: each module's output bytes per example (``ModelShape.module_bytes``), those of
a column-parallel module divided by ``tp`` (its output features are split); without a pipeline
times the rank's batch share ``ceil(batch_size / dp)``; with one, per stage (the blocks of the
stage, the prologue on stage 0, the epilogue on the last) times one microbatch
``ceil(share / microbatches)``, weighed by the schedule's microbatches in flight
(``schedule_sim.peak_held_by_rank``). A private job without a pipeline counts its
activations ``PRIVATE_ACTIVATION_FACTOR`` times, as the data-parallel techniques do. A private
pipeline's rank holds a microbatch's activations from its ``F`` to its ``B`` and then its
examples' contributions (``memory.contribution_bytes``: factors or per-example gradients, per
stage, on the meta device) until its ``W``, which the private policy forms in a wait or after
the list (``private_sim.private_held_by_rank`` on ``simulate_private`` with equal costs, as
``step_units``). With equal costs no 1f1b rank waits in its steady state, so every rank holds
all ``m`` microbatches' contributions at its last ``B``: more microbatches do not shrink a
private 1f1b's peak, and a rank that waits in practice holds fewer (an upper bound there;
measured in ``benchmarks/pipeline.py``'s memory table). With ``tp`` the contributions are those of
the blocks tensor-parallel rank 0 computes with (the largest where a split is uneven).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import nn

from fsdpx.sharding.cost_model import comm_per_step, memory_by_rank, peak_gathered_bytes
from fsdpx.sharding.layout import local_shape
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.pipeline import PipelinePlanError, rank_plan
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.schedule import schedule as make_schedule
from fsdpx.sharding.private_sim import private_held_by_rank, simulate_private
from fsdpx.sharding.schedule_sim import peak_held_by_rank, simulate
from fsdpx.sharding.tensor_parallel import ColumnParallel, TensorParallelPlanError
from fsdpx.train.errors import ConfigError
from fsdpx.train.layout import Layout
from fsdpx.train.parallel import resolve_parallel

from .memory import PRIVATE_ACTIVATION_FACTOR, contribution_bytes, model_shape
from .task import Task


class Resolved(NamedTuple):
    model: nn.Module  # on the meta device
    plan: ShardingPlan
    mesh: Mesh


@lru_cache(maxsize=256)
def plan_of(task: Task, n: int, layout: Layout) -> Resolved | None:
    """The job's model (meta) with its plan and mesh under ``layout`` on ``n`` ranks, or None
    when the degrees do not fit ``n`` or the model (see the module doc)."""
    if n % (layout.tp * layout.pp):
        return None
    mesh = layout.mesh(n)
    with torch.device("meta"):
        model = task.model_fn(task.hparams)
    try:
        plan = resolve_parallel(layout, model, mesh).plan
    except (ConfigError, TensorParallelPlanError, PipelinePlanError):
        return None
    return Resolved(model, plan, mesh)


def stage_of_modules(model: nn.Module, plan: ShardingPlan) -> dict[str, int]:
    """Each module's pipeline stage: a block's (and its submodules') the stage of the block;
    modules registered before the block list stage 0, after it (and the root, whose output is
    the model's) the last stage."""
    layout = plan.pipeline
    last = layout.num_stages - 1
    of_block = {b: s for s, blocks in enumerate(layout.stages) for b in blocks}
    keys = list(dict(model.named_modules())[layout.blocks]._modules)
    prefix = f"{layout.blocks}."
    out, after = {}, False
    for name, _ in model.named_modules():
        if name.startswith(prefix):
            out[name] = of_block[keys.index(name[len(prefix):].split(".", 1)[0])]
            after = True
        elif name == layout.blocks:
            out[name] = 0
        else:
            out[name] = last if (after or name == "") else 0
    return out


def activation_bytes(task: Task, resolved: Resolved) -> list[int]:
    """Peak activation bytes of each pipeline index (one entry without a pipeline; a private
    pipeline's include the contributions it holds), as the module doc says."""
    shape, plan, mesh = model_shape(task), resolved.plan, resolved.mesh
    tp = mesh.axis_size(plan.tp_axis) if plan.tp_axis else 1
    split = {m for m, st in plan.modules.items() if isinstance(getattr(st, "style", st), ColumnParallel)}
    per_module = {name: (b // tp if name in split else b) for name, b in shape.module_bytes}
    share = math.ceil(task.batch_size / mesh.axis_size(plan.data_axes))
    layout = plan.pipeline
    if layout is None:
        factor = PRIVATE_ACTIVATION_FACTOR if task.private else 1.0
        return [round(factor * sum(per_module.values()) * share)]
    stage = stage_of_modules(resolved.model, plan)
    per_stage = [0] * layout.num_stages
    for name, b in per_module.items():
        per_stage[stage[name]] += b
    micro = math.ceil(share / layout.microbatches)
    sched = make_schedule(layout.schedule, layout.degree(), layout.microbatches,
                          virtual_stages=layout.virtual_stages)
    if not task.private:
        return [round(micro * held) for held in peak_held_by_rank(sched, per_stage)]
    blocks = () if tp == 1 else tuple(  # what tensor-parallel rank 0 (the largest blocks) computes with
        (n, L.param_shape(local_shape(L.shape, L.compute, mesh, 0))) for n, L in sorted(plan.params.items()))
    kept = contribution_bytes(task, micro, tuple(stage.items()), layout.num_stages, blocks)
    timeline = simulate_private(sched)  # equal costs, as step_units: no 1f1b rank waits in its steady state
    return [round(b) for b in private_held_by_rank(timeline, [micro * b for b in per_stage], kept)]


def memory(task: Task, n: int, degrees: Layout) -> int | None:
    """Estimated peak bytes on the worst of ``n`` ranks under ``degrees`` (module doc); None
    when the degrees do not fit."""
    resolved = plan_of(task, n, degrees)
    if resolved is None:
        return None
    shape, plan, mesh = model_shape(task), resolved.plan, resolved.mesh
    acts = activation_bytes(task, resolved)
    worst = 0
    for index, act in enumerate(acts):  # one representative rank per pipeline index: its dp/tp rank 0
        rank = next(r for r in range(mesh.size)
                     if plan.pipeline is None or mesh.index(r, plan.pipeline.axis) == index)
        own = rank_plan(plan, mesh, rank)
        shapes = {k: shape.param_shapes[k] for k in own.params}
        units = [[p for p in u if p in own.params] for u in shape.units]
        units = [u for u in units if u]
        state = memory_by_rank(own, shapes, mesh, optimizer="adamw")[rank]
        gathered = peak_gathered_bytes(own, shapes, mesh, units) if units else 0
        worst = max(worst, state + gathered + act)
    return worst


def sent_bytes(task: Task, n: int, degrees: Layout) -> int | None:
    """Bytes rank 0 sends per step of a batch of ``round(batch_size)`` examples: the plan's
    parameter collectives, tensor-parallel activation collectives (traced on the meta model,
    ``fsdpx.runtime.activation_cost``) and, with a pipeline, its messages
    (``pipeline_comm_per_step``). None when the degrees do not fit."""
    from fsdpx.runtime.activation_cost import activation_collectives, pipeline_activation_collectives
    from fsdpx.sharding.pipeline import pipeline_comm_per_step

    resolved = plan_of(task, n, degrees)
    if resolved is None:
        return None
    shape, (model, plan, mesh) = model_shape(task), resolved
    batch = max(1, round(task.batch_size))
    inputs, targets = (batch, *shape.example_shape), (batch, *shape.target_shape)
    if plan.pipeline is None:
        acts = activation_collectives(model, plan, mesh, task.loss_fn, inputs, targets, private=task.private,
                                      input_dtype=shape.input_dtype)
        return int(comm_per_step(plan, shape.param_shapes, mesh, [list(u) for u in shape.units],
                                 activations=acts)["send_bytes"])
    acts = pipeline_activation_collectives(model, plan, mesh, task.loss_fn, inputs, targets, shape.hidden,
                                           input_dtype=shape.input_dtype)
    return int(pipeline_comm_per_step(plan, mesh, 0, batch_size=batch, hidden=shape.hidden, dtype=torch.float32,
                                      private=task.private, activations=acts)["send_bytes"])


def step_units(degrees: Layout, *, private: bool = False) -> float:
    """A pipeline's step time in units of its rank's compute (``F + B + W`` of its whole share =
    3): the schedule simulated with each action costing its share, ``1 / (microbatches x
    virtual_stages)``; 3 without a pipeline. The bubble the choice of schedule and microbatches
    trades against memory. ``private``: run as a private pipeline (``simulate_private``: each
    ``W`` a microbatch's clipped sums, formed in waits or after the list), where zero-bubble's
    deferred ``W``s gain nothing over 1f1b (``tests/test_jobs_parallel.py``)."""
    if degrees.pp == 1:
        return 3.0
    share = 1.0 / (degrees.microbatches * degrees.virtual_stages)
    sched = make_schedule(degrees.schedule, degrees.pp, degrees.microbatches, virtual_stages=degrees.virtual_stages)
    run = simulate_private if private else simulate
    return run(sched, {"F": share, "B": share, "W": share}).makespan
