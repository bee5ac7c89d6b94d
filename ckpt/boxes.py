"""Box arithmetic for checkpoints, pure: who writes which block, global shapes from local ones,
and which byte runs of a stored block a reader needs.

A box is a global ``[start, stop)`` per dim (``fsdpx.sharding.layout.local_box``). A stored box is
C-contiguous on disk, so the part of it inside another box is a set of contiguous *runs*: if
the last dim where the intersection is narrower than the stored box is ``j``, each run covers
the intersection along ``j`` and everything after it, and there is one run per index of the
dims before ``j``. A box sharded on dim 0 therefore reads as one run.

Guarantees (``tests/test_ckpt_boxes.py``):
  * ``runs`` lists exactly the bytes of the intersection, in its C order, each once
    (``test_runs_read_exactly_the_intersection``), so reads are never amplified.
  * ``writer_ranks`` picks exactly one rank per distinct non-empty box: the lowest rank
    holding it (coordinate 0 on every replicated axis) (``test_each_box_written_once``).
  * ``global_shape`` inverts ``local_box``: it raises ``LayoutError`` naming the tensor unless
    every rank's local shape is exactly its box of the inferred shape.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from fsdpx.sharding import Mesh, Spec
from fsdpx.sharding.layout import local_box

from .errors import LayoutError

Box = tuple[tuple[int, int], ...]


def extents(box: Box) -> tuple[int, ...]:
    return tuple(e - s for s, e in box)


def is_writer(spec: Spec, mesh: Mesh, rank: int) -> bool:
    """Does ``rank`` store its block of a tensor laid out as ``spec``? Yes iff it is the first
    replica: coordinate 0 on every replicated axis. Partial (unreduced) specs are refused."""
    if spec.partial:
        raise LayoutError(f"{spec} is partial (unreduced): reduce it before checkpointing")
    coords = mesh.coords(rank)
    return all(coords[a] == 0 for a in spec.replicated_axes(mesh))


def global_shape(path: str, local_shapes: Sequence[Sequence[int]], spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    """The global shape whose ``local_box`` on each rank has the given local shape: along each
    dim, the sum of the local sizes over rank 0's group of that dim's axes."""
    if len(local_shapes) != mesh.size:
        raise LayoutError(f"{path}: {len(local_shapes)} local shapes for {mesh.size} ranks")
    if any(len(s) != spec.ndim for s in local_shapes):
        raise LayoutError(f"{path}: local shapes {list(map(tuple, local_shapes))} do not all have {spec.ndim} dims ({spec})")
    try:
        spec.validate_axes(mesh)
        shape = tuple(sum(local_shapes[r][d] for r in mesh.groups(spec.axes(d))[0]) for d in range(spec.ndim))
    except ValueError as e:
        raise LayoutError(f"{path}: {e}") from None
    for r, s in enumerate(local_shapes):
        if tuple(s) != extents(local_box(shape, spec, mesh, r)):
            raise LayoutError(f"{path}: rank {r} holds shape {tuple(s)}, but {spec} of global {shape} on {mesh} "
                              f"gives it {extents(local_box(shape, spec, mesh, r))}")
    return shape


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` if it holds no element."""
    out = tuple((max(sa, sb), min(ea, eb)) for (sa, ea), (sb, eb) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def runs(stored: Box, inter: Box, itemsize: int) -> tuple[np.ndarray, int]:
    """Byte offsets (relative to the stored box's first byte) of the runs making up ``inter``
    inside ``stored``, in C order, and the length in bytes of every run."""
    ext = extents(stored)
    strides = [math.prod(ext[d + 1:]) for d in range(len(ext))]
    lo = [s - s0 for (s, _), (s0, _) in zip(inter, stored)]
    hi = [e - s0 for (_, e), (s0, _) in zip(inter, stored)]
    partial = [d for d in range(len(ext)) if hi[d] - lo[d] < ext[d]]
    if not partial:
        return np.zeros(1, dtype=np.int64), math.prod(ext) * itemsize
    j = partial[-1]
    length = (hi[j] - lo[j]) * strides[j] * itemsize
    offsets = np.array([lo[j] * strides[j]], dtype=np.int64)
    for d in reversed(range(j)):
        steps = np.arange(lo[d], hi[d], dtype=np.int64) * strides[d]
        offsets = (steps[:, None] + offsets[None, :]).reshape(-1)
    return offsets * itemsize, length
