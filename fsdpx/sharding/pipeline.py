"""Pipeline parallelism as data: which blocks and parameters each stage holds, and the schedule.

A model is a prologue (everything its forward runs before its block list: embeddings), a list
of blocks (``nn.ModuleList``: the transformer layers) and an epilogue (final norm, LM head).
Pipeline parallelism over mesh axis ``axis`` (size ``p``) cuts the blocks into ``S = p * v``
contiguous stages (``v`` virtual stages per rank, placed looped: stage ``s`` on the rank with
``axis`` index ``s % p``); the prologue's parameters belong to stage 0, the epilogue's to stage
``S - 1``, and a parameter used in both (a tied embedding and LM head) to both, its gradients
summed between them as Megatron does.

A ``PipelineLayout`` is that table plus the schedule's kind and microbatch count; it rides on
the ``ShardingPlan`` (``ShardingPlan.pipeline``), whose per-parameter layouts say how each
stage's parameters are further split over the data and tensor axes. The runtime
(``fsdpx.runtime.pipeline``) and the cost model read only this data.

Which side of the block list a parameter is on: ``PipelineParallel.prologue`` names the
parameters the forward uses before its blocks (``fsdpx.runtime.stages.traced_prologue`` finds
them by running the forward once; ``fsdpx train`` does). Without it, the model's registration
order (``named_parameters``) is taken: modules registered before the block list form the
prologue, after it the epilogue. That is how transformers' GPT-2, Llama and this library's GPT
are written, not OPT (its final norm is registered before its layers); a stage that runs a
module whose parameters another stage holds where its output counts raises
``PipelinePlanError`` naming it (``fsdpx.runtime.stages``), never trains on the stand-ins.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from .collectives import cost, plan as plan_collectives
from .layout import chunk_bounds, local_shape, unshard
from .mesh import Mesh
from .plan import ShardingPlan
from .schedule import KINDS, SEND_B, SEND_F, schedule as make_schedule
from .spec import Spec


class PipelinePlanError(ValueError):
    """A pipeline that does not fit the model, the mesh or the batch, named before anything runs."""


@dataclass(frozen=True)
class PipelineParallel:
    """What the user asks for (resolved by :func:`resolve_pipeline`).

    * ``axis``: the mesh axis the stages are spread over.
    * ``schedule``: a kind of ``fsdpx.sharding.schedule.KINDS``; ``microbatches``: per step, per
      data-parallel rank; ``virtual_stages``: stages per rank (``interleaved_1f1b``).
    * ``blocks``: the module path of the block list (default: the ``nn.ModuleList`` holding the
      most parameters).
    * ``split``: blocks per stage, e.g. ``(3, 2, 2, 1)`` (default: :func:`balanced_split` of the
      blocks' matrix-product parameters, the prologue's counted on stage 0 and the epilogue's,
      the LM head, on the last).
    * ``prologue``: the parameters (as ``named_parameters(remove_duplicate=False)`` names them:
      a tied weight by the module that uses it before the blocks) of stage 0 outside the blocks;
      every other one outside the blocks is the last stage's (default: registration order).
    """

    axis: str = "pp"
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    blocks: str | None = None
    split: tuple[int, ...] | None = None
    prologue: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PipelineLayout:
    """The resolved pipeline: ``stages[s]`` is the block indices of stage ``s`` (contiguous, in
    order, every block exactly once); ``param_stages[name]`` the stages holding parameter
    ``name`` (one, or two for a tied embedding and head); ``blocks`` the block list's path."""

    axis: str
    schedule: str
    microbatches: int
    virtual_stages: int
    blocks: str
    stages: tuple[tuple[int, ...], ...]
    param_stages: Mapping[str, tuple[int, ...]]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def degree(self) -> int:
        """``p``: ranks along ``axis``."""
        return self.num_stages // self.virtual_stages

    def stages_on(self, index: int) -> tuple[int, ...]:
        """The stages the rank with pipeline index ``index`` runs: ``index, index + p, ...``."""
        return tuple(range(index, self.num_stages, self.degree()))

    def params_of(self, stages: Sequence[int]) -> list[str]:
        """Parameter names held by any of ``stages``, in the plan's order."""
        want = set(stages)
        return [n for n, held in self.param_stages.items() if want.intersection(held)]


def pipeline_index(mesh: Mesh, rank: int, layout: PipelineLayout) -> int:
    return mesh.index(rank, layout.axis)


def rank_plan(plan: ShardingPlan, mesh: Mesh, rank: int) -> ShardingPlan:
    """``plan`` restricted to the parameters ``rank`` holds: all of them without a pipeline,
    else those of the stages on ``rank``'s pipeline index. The layouts themselves (over the data
    and tensor axes) are unchanged."""
    if plan.pipeline is None:
        return plan
    names = plan.pipeline.params_of(plan.pipeline.stages_on(pipeline_index(mesh, rank, plan.pipeline)))
    return dataclasses.replace(plan, params={n: plan.params[n] for n in names})


def balanced_split(costs: Sequence[float], num_stages: int, *, first: float = 0.0,
                   last: float = 0.0) -> tuple[int, ...]:
    """Blocks per stage: the contiguous split of ``costs`` into ``num_stages`` non-empty runs
    whose largest cost is smallest, where stage 0 also costs ``first`` (the prologue) and the
    last stage ``last`` (the epilogue: the LM head and the loss); among equal maxima, the most
    even (smallest sum of squared stage costs). Exact (dynamic programming over prefixes).

    Raises ``PipelinePlanError`` if there are more stages than blocks."""
    n = len(costs)
    if num_stages < 1:
        raise PipelinePlanError(f"a pipeline needs at least one stage, got {num_stages}")
    if num_stages > n:
        raise PipelinePlanError(f"{num_stages} pipeline stages but only {n} blocks: every stage needs a block")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[k][i]: over the first i blocks in k runs, the smallest (largest run, sum of squared
    # runs): the second breaks ties towards even stages; cut[k][i]: where run k starts
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            extra = (first if k == 1 else 0.0) + (last if k == num_stages else 0.0)
            for j in range(i - 1, k - 2, -1):  # last run is [j, i); latest start first = shortest last run
                run = prefix[i] - prefix[j] + extra
                v = (max(best[k - 1][j][0], run), best[k - 1][j][1] + run * run)
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return tuple(reversed(sizes))


def _compute_cost(module: nn.Module) -> int:
    """A stage's compute, proxied by the parameters its matrix products read: every parameter
    of ``module``'s tree except embedding tables (a lookup reads one row per token)."""
    return sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False))


def _outside_costs(model: nn.Module, blocks: str, prologue: Sequence[str] | None = None) -> tuple[int, int]:
    """``_compute_cost`` of the modules outside the block list before it (the prologue) and after
    it (the epilogue: a tied LM head counts, through the module that multiplies by it): a module
    is the prologue's when ``prologue`` names one of its parameters, else (no ``prologue``)
    when it is registered before the block list."""
    before = after = 0
    seen = False
    prefix = f"{blocks}."
    named = set(prologue or ())
    for name, m in model.named_modules(remove_duplicate=False):
        if name == blocks or name.startswith(prefix):
            seen = True
            continue
        if isinstance(m, nn.Embedding):
            continue
        own = [(f"{name}.{k}" if name else k, p) for k, p in m.named_parameters(recurse=False)]
        cost = sum(p.numel() for _, p in own)
        first = any(alias in named for alias, _ in own) if prologue is not None else not seen
        if first:
            before += cost
        else:
            after += cost
    return before, after


def find_blocks(model: nn.Module, path: str | None = None) -> str:
    """The block list's module path: ``path`` if given (checked), else the ``nn.ModuleList``
    holding the most parameters. ``PipelinePlanError`` if there is none."""
    modules = dict(model.named_modules())
    if path is not None:
        if not isinstance(modules.get(path), nn.ModuleList):
            raise PipelinePlanError(f"{path!r} is not an nn.ModuleList of the model")
        return path
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in modules.items()
             if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise PipelinePlanError("the model has no nn.ModuleList of blocks to cut into stages")
    return max(lists)[1]


def resolve_pipeline(model: nn.Module, plan: ShardingPlan, spec: PipelineParallel, mesh: Mesh) -> ShardingPlan:
    """``plan`` (any data/tensor-parallel plan of ``model``) with ``spec``'s pipeline resolved
    on it: ``ShardingPlan.pipeline`` set, layouts unchanged.

    Guarantees: every parameter of the plan is held by at least one stage; block parameters by
    exactly the stage of their block; the stages tile the blocks in order
    (``tests/test_pipeline.py``).

    Raises ``PipelinePlanError`` (before anything runs) for: the mesh lacking ``spec.axis``, the
    axis also carrying data or tensor parallelism, an unknown schedule kind, a schedule that
    cannot run ``spec.microbatches`` (interleaved needs a multiple of ``p``), more stages than
    blocks, a ``split`` that does not cover the blocks, a parameter shared between blocks of
    different stages, and sequence parallelism (not supported with a pipeline yet)."""
    if spec.axis not in mesh.axis_names:
        raise PipelinePlanError(f"the pipeline runs over axis {spec.axis!r}, which {mesh} lacks")
    if spec.axis in plan.data_axes or spec.axis == plan.tp_axis:
        raise PipelinePlanError(f"axis {spec.axis!r} cannot carry both pipeline and data or tensor parallelism")
    if plan.sequence_dim is not None:
        raise PipelinePlanError("sequence parallelism with a pipeline is not supported yet: stages exchange the"
                                " whole hidden state")
    if spec.schedule not in KINDS:
        raise PipelinePlanError(f"unknown schedule kind {spec.schedule!r}; kinds are {KINDS}")
    p = mesh.axis_size(spec.axis)
    try:
        make_schedule(spec.schedule, p, spec.microbatches, virtual_stages=spec.virtual_stages)
    except (ValueError, TypeError) as e:
        raise PipelinePlanError(f"schedule {spec.schedule} on {p} stages: {e}") from None
    blocks = find_blocks(model, spec.blocks)
    block_list = dict(model.named_modules())[blocks]
    num_stages = p * spec.virtual_stages
    if spec.split is not None:
        split = spec.split
    else:
        first, last = _outside_costs(model, blocks, spec.prologue)
        split = balanced_split([_compute_cost(b) or 1 for b in block_list], num_stages, first=first, last=last)
    if len(split) != num_stages or sum(split) != len(block_list) or min(split) < 1:
        raise PipelinePlanError(f"split {tuple(split)} must give each of {num_stages} stages at least one of the"
                                f" {len(block_list)} blocks, in total all of them")
    stages, start = [], 0
    for size in split:
        stages.append(tuple(range(start, start + size)))
        start += size
    stage_of_block = {b: s for s, bs in enumerate(stages) for b in bs}
    held = _param_stages(model, plan, blocks, list(block_list._modules), stage_of_block, num_stages, spec.prologue)
    layout = PipelineLayout(spec.axis, spec.schedule, spec.microbatches, spec.virtual_stages, blocks, tuple(stages),
                            held)
    return dataclasses.replace(plan, pipeline=layout, name=f"{plan.name}+pp")


def _param_stages(model: nn.Module, plan: ShardingPlan, blocks: str, keys: list[str],
                  stage_of_block: dict[int, int], num_stages: int,
                  prologue: tuple[str, ...] | None) -> dict[str, tuple[int, ...]]:
    canonical = {id(p): n for n, p in model.named_parameters()}
    index_of_key = {k: i for i, k in enumerate(keys)}
    prefix = f"{blocks}." if blocks else ""
    held: dict[str, set[int]] = {}
    block_stage: dict[str, int] = {}
    seen_blocks = False
    for alias, p in model.named_parameters(remove_duplicate=False):
        name = canonical[id(p)]
        if name not in plan.params:
            continue
        if alias.startswith(prefix):
            stage = stage_of_block[index_of_key[alias[len(prefix):].split(".", 1)[0]]]
            seen_blocks = True
            if block_stage.setdefault(name, stage) != stage:
                raise PipelinePlanError(f"parameter {name!r} is shared by blocks of stages {block_stage[name]} and"
                                        f" {stage}; stages cannot share block parameters")
        elif prologue is not None:
            stage = 0 if alias in prologue else num_stages - 1
        else:
            stage = num_stages - 1 if seen_blocks else 0
        held.setdefault(name, set()).add(stage)
    return {n: tuple(sorted(held[n])) for n in plan.params}


def unshard_stages(per_rank: Sequence[Mapping[str, Tensor]], plan: ShardingPlan, mesh: Mesh, *,
                   layout: str = "at_rest") -> dict[str, Tensor]:
    """Every parameter of ``plan`` assembled from each rank's tensors (``per_rank[r]`` holds
    only rank ``r``'s parameters under a pipeline), in the layout's (view) shape; ``layout``
    names the ``ParamLayout`` spec they follow (``"opt_state"`` for optimizer moments).

    Guarantees: without a pipeline this is ``layout.unshard`` per parameter; a parameter held by
    several pipeline ranks (a tied embedding and head) must be bit-identical on all of them,
    else ``ValueError`` naming it (the copies drifting apart is always a bug)."""
    if plan.pipeline is None:
        return {n: unshard([per_rank[r][n] for r in range(mesh.size)], getattr(lay, layout), mesh)
                for n, lay in plan.params.items()}
    pipe = plan.pipeline
    sub = mesh.sub(tuple(a for a in mesh.axis_names if a != pipe.axis))
    out = {}
    for n, lay in plan.params.items():
        copies = []
        for j in sorted({s % pipe.degree() for s in pipe.param_stages[n]}):
            ranks = [r for r in range(mesh.size) if mesh.index(r, pipe.axis) == j]
            copies.append(unshard([per_rank[r][n] for r in ranks], getattr(lay, layout), sub))
        if any(not torch.equal(copies[0], c) for c in copies[1:]):
            raise ValueError(f"parameter {n!r} differs between the pipeline stages that hold it")
        out[n] = copies[0]
    return out


def pipeline_comm_per_step(plan: ShardingPlan, mesh: Mesh, rank: int, *, batch_size: int,
                           hidden: Sequence[int], dtype: torch.dtype, private: bool = False,
                           activations: Sequence = ()) -> dict[str, int]:
    """Bytes ``rank`` moves in one pipelined step of a global batch of ``batch_size`` examples,
    as ``fsdpx.sharding.cost`` counts them (``{kind: bytes}`` plus ``send_bytes``/``recv_bytes``;
    ``p2p`` for the point-to-point messages). ``hidden``: the shape of one example's hidden
    state between blocks (e.g. ``(T, C)``); ``dtype``: the parameters' and activations' dtype.

    What the runtime runs (``fsdpx.runtime.pipeline``), per stage of the rank and microbatch:
    the forward gathers every stage parameter (``ParamLayout.forward_transitions``); with
    resharding, the backward gathers again the block parameters, and the prologue/epilogue ones
    only at the last stage (a stage that stops early keeps them). Once per step: each
    parameter's reduction and update transitions, and one message per other pipeline rank
    holding a shared parameter (its raw gradient). Activations: one message per ``SEND_F`` and
    ``SEND_B`` of a non-empty microbatch, ``size x prod(hidden)`` elements.

    ``private``: the all-reduce of the rank's batch share of squared norms over the pipeline
    and tensor axes (those of size > 1): one per non-empty microbatch when no parameter is held
    by two stages, else one after the schedule; per stage of the rank and non-empty microbatch,
    one all-reduce over ``tp`` of the ``[b, n]`` per-example gradients of the stage's parameters
    whose raw gradient is partial over it (``ReplicatedOnSplit``: Qwen3's per-head norms); and, for a parameter several pipeline ranks
    hold, each holder but the last sends its per-example contributions of every non-empty microbatch as a
    self-described message (``fsdpx.runtime.parts_p2p``: its length, a header of 14 int64, the
    ids ``[b, steps]`` int64 and the gradients ``[b, steps, n]``). That is the message of an
    embedding lookup of the sequence (``steps = prod(hidden[:-1])``, ``n`` the parameter's local
    width): the parameter pipelines share is a tied input embedding and LM head, whose first
    holder is the embedding.

    ``activations``: tensor-parallel activation collectives, added as they are (for a
    pipeline, ``fsdpx.runtime.activation_cost.pipeline_activation_collectives`` traces each
    stage of the rank for each microbatch).
    Guarantee: the simulated mesh counts exactly this for rank 0, plain and private, with and
    without tensor parallelism
    (``property_tests/test_pipeline_properties.py::test_counted_bytes_equal_pipeline_comm_per_step``)."""
    layout = plan.pipeline
    p, item = layout.degree(), dtype.itemsize
    index = mesh.index(rank, layout.axis)
    sub = mesh.sub(tuple(a for a in mesh.axis_names if a != layout.axis))
    coords = mesh.coords(rank)
    sub_rank = sub.rank_of({a: coords[a] for a in sub.axis_names})
    a, b = chunk_bounds(batch_size, mesh.axis_size(plan.data_axes), mesh.index(rank, plan.data_axes))
    sizes = [hi - lo for lo, hi in microbatch_bounds(b - a, layout.microbatches)]
    block_prefix = f"{layout.blocks}." if layout.blocks else ""
    collectives = []

    def transitions(name: str, ts) -> None:
        lay = plan.params[name]
        for t in ts:
            collectives.extend(plan_collectives(t.src, t.dst, lay.shape, sub, dtype))

    last = layout.num_stages - 1
    for s in layout.stages_on(index):
        names = layout.params_of([s])
        for _ in sizes:
            for n in names:
                transitions(n, plan.params[n].forward_transitions())
            if plan.reshard_after_forward:
                for n in names:
                    if n.startswith(block_prefix) or s == last:
                        transitions(n, plan.params[n].forward_transitions())
    own = layout.params_of(layout.stages_on(index))
    if private:
        axes = tuple(a for a in mesh.axis_names if a in (layout.axis, plan.tp_axis) and mesh.axis_size(a) > 1)
        # no parameter in two stages: one all-reduce per non-empty microbatch, as its backwards
        # end; else one of the whole share after the schedule
        early = all(len(held) == 1 for held in layout.param_stages.values())
        src = Spec.replicated(1)
        for n_sq in ([size for size in sizes if size] if early else [b - a]) if axes else []:
            collectives.extend(plan_collectives(src.with_partial(axes), src, (n_sq,), mesh.sub(axes), dtype))
        tp = plan.tp_axis
        if tp is not None and mesh.axis_size(tp) > 1:  # ReplicatedOnSplit: [B, n] summed over tp per stage
            for s in layout.stages_on(index):
                width = sum(plan.numel(n) for n in layout.params_of([s]) if tp in plan.params[n].raw_grad.partial)
                for size in sizes if width else []:
                    if size:
                        collectives.extend(plan_collectives(Spec.replicated(2).with_partial((tp,)), Spec.replicated(2),
                                                            (size, width), mesh.sub((tp,)), dtype))
    for n in own:
        transitions(n, [t for t in plan.params[n].backward_transitions(False) if t.phase == "reduce_grad"])
    for n in own:
        transitions(n, plan.params[n].update_transitions())
    out = cost(collectives + list(activations))
    p2p = 0  # bytes sent point to point
    parts_sent = parts_received = 0  # of them, contribution messages (one way: to the last holder)
    if private:
        steps = math.prod(hidden[:-1])
        first_tp = plan.tp_axis is None or mesh.index(rank, plan.tp_axis) == 0
        for n in own:
            holders = sorted({s % p for s in layout.param_stages[n]})
            lay = plan.params[n]
            counted = first_tp or (plan.tp_axis in lay.compute.sharding_axes)  # as the runtime's norms count
            if len(holders) < 2 or not counted:
                continue
            width = lay.param_shape(local_shape(lay.shape, lay.compute, sub, sub_rank))[1]
            # per non-empty microbatch: length, header, one-hot ids, their gradients
            message = sum(8 + 14 * 8 + size * steps * 8 + size * steps * width * item for size in sizes if size)
            if index != holders[-1]:
                parts_sent += message
            else:
                parts_received += message * (len(holders) - 1)
        p2p += parts_sent
    for n in own:
        holders = {s % p for s in layout.param_stages[n]}
        if len(holders) > 1:
            p2p += (len(holders) - 1) * math.prod(local_shape(plan.params[n].shape, plan.params[n].compute, sub,
                                                               sub_rank)) * item
    sched = make_schedule(layout.schedule, p, layout.microbatches, virtual_stages=layout.virtual_stages)
    per_example = math.prod(hidden) * item
    for act in sched.ranks[index]:
        if isinstance(act, (SEND_F, SEND_B)):
            p2p += sizes[act.mb] * per_example
    if p2p or p > 1:
        out["p2p"] = p2p
        out["send_bytes"] += p2p
        out["recv_bytes"] += p2p - parts_sent + parts_received  # activations, gradients: as much each way
    return out


def microbatch_bounds(n: int, m: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``m`` microbatches of ``n`` examples: the first ``n % m``
    hold ``ceil(n / m)``, the rest ``floor(n / m)`` (``torch.tensor_split``); some are empty
    when ``n < m`` (``tests/test_pipeline.py``)."""
    base, extra = divmod(n, m)
    out, start = [], 0
    for i in range(m):
        out.append((start, start + base + (i < extra)))
        start += base + (i < extra)
    return out
