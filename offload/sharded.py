"""ZenFlow on row shards: the one collective that makes every rank choose as the unsharded run.

Under ZeRO-2/3 (``fsdpx.sharding.strategies``) the optimizer of each rank sees a block of rows of every
weight ``[out, in]``. A column's score is a sum over rows, so the global score is the sum of the
ranks' scores: one all-reduce of ``in`` float64 values per weight, at each selection. The rows
themselves never move: each rank's host master, moments and window accumulators stay those of its
own rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fsdpx.sharding.collectives import plan
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.mesh import as_axes
from fsdpx.sharding.spec import Spec
from offload.zenflow import CombineScores


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
