"""ZenFlow on shards: the collectives that make every rank choose as the unsharded run.

Under ZeRO-2/3 (``fsdpx.sharding.strategies``) the optimizer of each rank sees a block of rows of every
weight ``[out, in]``. A column's score is a sum over rows, so the global score is the sum of the
ranks' scores: one all-reduce of ``in`` float64 values per weight, at each selection. The rows
themselves never move: each rank's host master, moments and window accumulators stay those of its
own rows. Under tensor parallelism a weight may also have its columns split (a row-parallel
layer): its scores are then gathered over those axes, the top-k chosen on the whole vector, and
each rank keeps the chosen columns it holds (``layout_scores``).
"""

from __future__ import annotations

import torch
from torch import Tensor

import math
from typing import Mapping

from fsdpx.sharding.collectives import plan
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import local_box
from fsdpx.sharding.mesh import as_axes
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.spec import Spec
from offload.zenflow import CombineScores, CombineStats, LocalColumns


def sharded_scores(comm: Comm, axes: str | tuple[str, ...]) -> CombineScores:
    """``combine_scores`` for ``offload.zenflow`` when rows are split over the mesh ``axes``: the
    sum of every rank's vector over ``axes``, by ``comm``'s all-reduce. ``axes`` are the axes the
    optimizer state's dim 0 is split over: the data axes for ZeRO-1/2/3, the shard axis alone
    for HSDP (replicas hold the same rows; summing over them would count each row twice). DDP
    needs no hook: every rank holds every row.

    Guarantees:
      - Every rank of a group gets the same bits (the all-reduce's), so every rank makes the
        same selection and the same ``"auto"`` decisions, and their collectives stay in step.
      - Selection is world-size invariant up to float64 rounding of the sum: the scores of
        ``k`` row blocks summed differ from the unsharded ``column_scores`` by at most
        ``out * 2**-53`` relative (``offload.columns.column_scores``), so only columns whose
        scores tie to that precision can be ordered differently; exact ties stay exact.
      - One ``all_reduce`` of an ``8 * len(vector)``-byte buffer per call, counted by ``comm``
        like the train step's own collectives.

    Edge cases: a rank whose block has no rows contributes zeros; axes of size 1 give back a copy
    of the vector; ``axes=()`` runs no collective and returns the vector itself. Raises ``ValueError`` (from ``plan``) if an
    axis is not in ``comm.mesh``, ``TypeError`` if a vector is not 1-D float64."""
    axes = as_axes(axes)

    def combine(name: str, local: Tensor) -> Tensor:
        if local.dim() != 1 or local.dtype != torch.float64:
            raise TypeError(f"{name}: expected a 1-D float64 vector of row sums, got {local.dtype} "
                            f"{tuple(local.shape)}")
        out = local
        for collective in plan(Spec(None, partial=axes), Spec(None), tuple(local.shape), comm.mesh, torch.float64):
            out = comm.run(collective, out)
        return out

    return combine


def layout_scores(comm: Comm, layouts: Mapping[str, tuple[Spec, tuple[int, ...], int]], *,
                  stage_axis: str | None = None) -> tuple[CombineScores, LocalColumns]:
    """``(combine_scores, local_columns)`` for ``offload.zenflow`` when each weight is laid out by
    its own spec: ``layouts[name] = (spec of the optimizer state, global shape, b)``, the
    weight's rows being the dims before ``b`` and its columns the rest (``b = 1`` for a plain
    ``[out, in]``; a tensor-parallel plan's fused view ``[3, n, in]`` has ``b = 2``). Tensor
    parallelism splits some weights' rows, others' columns; ZeRO adds the data axes.
    ``combine_scores`` sums this rank's vector over the axes the rows are split over (one
    all-reduce) and gathers it over those the columns are split over (one all-gather), giving
    every column's score in the weight's own column order; ``local_columns`` is the sorted
    indices of this rank's columns in that vector. ``stage_axis``: under a pipeline, the mesh
    axis its stages are split over; each weight's collectives then run among its own stage's
    ranks (the stages hold different weights).

    Guarantees (``property_tests/test_zenflow_model_parallel.py``): every rank of a weight's
    group gets the same bits (the collectives'), so each chooses the same global top-k; the
    vector is the unsharded ``column_scores`` up to float64 rounding of the row sums, as
    :func:`sharded_scores` says. A weight not in ``layouts`` is combined by neither collective.

    Raises ``TypeError`` if a vector is not 1-D float64 (a 2-element window statistic of the
    ``"auto"`` rules is refused by ``offload.zenflow`` before it gets here)."""

    mesh = comm.mesh if stage_axis is None else comm.mesh.sub(tuple(a for a in comm.mesh.axis_names if a != stage_axis))

    def axes(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if name not in layouts:
            return (), ()
        spec, _, b = layouts[name]
        return (tuple(a for d in range(b) for a in spec.axes(d)),
                tuple(a for d in range(b, spec.ndim) for a in spec.axes(d)))

    def combine(name: str, local: Tensor) -> Tensor:
        if local.dim() != 1 or local.dtype != torch.float64:
            raise TypeError(f"{name}: expected a 1-D float64 vector of row sums, got {local.dtype} "
                            f"{tuple(local.shape)}")
        rows, cols = axes(name)
        out = local
        if rows:
            for c in plan(Spec(None, partial=rows), Spec(None), tuple(local.shape), mesh, torch.float64):
                out = comm.run(c, out)
        if cols:
            spec, shape, b = layouts[name]
            box = local_box(shape, spec, comm.mesh, comm.rank)[b:]
            out = out.reshape(tuple(e - s for s, e in box))
            for c in plan(Spec(*spec.dims[b:]), Spec(*[None] * len(box)), shape[b:], mesh, torch.float64):
                out = comm.run(c, out)
            out = out.reshape(-1)
        return out

    def local_columns(name: str) -> Tensor:
        spec, shape, b = layouts[name]
        box = local_box(shape, spec, comm.mesh, comm.rank)[b:]
        every = torch.arange(math.prod(shape[b:])).reshape(shape[b:])
        return every[tuple(slice(s, e) for s, e in box)].reshape(-1)

    return combine, local_columns


def layout_stats(comm: Comm, sharding: ShardingPlan) -> CombineStats:
    """``combine_stats`` for ``offload.zenflow`` under a sharding plan (tensor and pipeline
    parallelism, ZeRO's data axes): every weight's sums over all ranks' blocks, each block
    counted once, for every 2-D weight of the plan in its order (the unsharded run's). A rank
    contributes the weights it holds and trains where it is the first replica of its block (the
    first stage holding the weight, coordinate 0 on every axis that does not split it); one
    all-reduce over the whole mesh of ``2 * weights`` float64 values per call, so every rank of
    every stage gets the same bits and makes the same ``"auto"`` window decision.

    Guarantee (``property_tests/test_zenflow_model_parallel.py::
    test_auto_intervals_decide_as_the_unsharded_run``): each weight's sums are its unsharded
    sums up to float64 rounding of the block sums; a frozen weight's are 0."""
    layouts = weight_layouts(sharding)
    names = list(layouts)
    pipeline = sharding.pipeline
    coords = comm.mesh.coords(comm.rank)

    def first_replica(name: str) -> bool:
        split = {a for d in range(layouts[name][0].ndim) for a in layouts[name][0].axes(d)}
        stage = None if pipeline is None else pipeline.axis
        if stage is not None and min(s % pipeline.degree() for s in pipeline.param_stages[name]) != coords[stage]:
            return False
        return all(c == 0 for a, c in coords.items() if a not in split and a != stage)

    counted = {n for n in names if first_replica(n)}

    def combine(local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        width = len(next(iter(local.values()))) if local else 2
        out = torch.zeros((len(names), width), dtype=torch.float64)
        for i, n in enumerate(names):
            if n in local and n in counted:
                out[i] = local[n]
        every = Spec(None, None, partial=comm.mesh.axis_names)
        for c in plan(every, Spec(None, None), tuple(out.shape), comm.mesh, torch.float64):
            out = comm.run(c, out)
        return {n: out[i] for i, n in enumerate(names)}

    return combine


def weight_layouts(plan: ShardingPlan) -> dict[str, tuple[Spec, tuple[int, ...], int]]:
    """``layout_scores``' ``layouts`` of a sharding plan: every 2-D weight (``b = 1``) and every
    fused view of one (:func:`matrix_views`), with its ``opt_state`` spec and global shape;
    other parameters are not weights ZenFlow selects in."""
    views = matrix_views(plan)
    out = {}
    for name, lay in plan.params.items():
        b = views.get(name, 1 if len(lay.shape) == 2 else 0)
        if b:
            out[name] = (lay.opt_state, lay.shape, b)
    return out


def matrix_views(plan: ShardingPlan) -> dict[str, int]:
    """``offload.zenflow``'s ``matrices`` of a sharding plan: for each parameter whose layout
    views it fused (``ParamLayout.fused``, a tensor-parallel plan's ``[3, n, in]`` of a fused
    ``[3n, in]`` weight), the dim its columns start at (2 when the rows are viewed so, 1 when
    the columns are), or 0 for a fused vector (``[3, n]`` of a ``[3n]`` bias: not a weight)."""
    out = {}
    for name, lay in plan.params.items():
        if lay.fused is not None:
            out[name] = 0 if len(lay.shape) < 3 else 2 if lay.fused[0] == 0 else 1
    return out
