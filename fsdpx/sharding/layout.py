"""Which piece of a global tensor each rank holds, and moving between the two views.

Chunking rule (``torch.chunk`` with empty padding, as DTensor's ``Shard._split_tensor``): a dim
of size ``n`` split into ``k`` chunks has chunk size ``c = ceil(n / k)``; chunk ``i`` is
``[min(i*c, n), min((i+1)*c, n))``. Leading chunks are full, then at most one short chunk, then
empty chunks: ``n=5, k=4`` gives sizes ``2, 2, 1, 0``.

A dim sharded over a tuple of axes ``(a, b)`` is cut ONCE into ``size(a) * size(b)`` chunks and
rank ``r`` holds chunk ``index_a(r) * size(b) + index_b(r)`` (JAX's flat rule). Note that this
differs from DTensor's nested ``[Shard(0), Shard(0)]`` (chunk of a chunk) when sizes are
uneven; ``chunks_nest`` says when the two agree, which is when a collective over the minor
axes alone can change the layout (``fsdpx.sharding.collectives``).

Partial axes: ``shard`` puts the whole value on the rank with coordinate 0 on every partial
axis and zeros (same local shape) on the others; ``unshard`` sums them in rank order.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .mesh import Mesh
from .spec import Spec

Box = tuple[tuple[int, int], ...]


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` of a length-``n`` dim cut into ``k`` torch.chunk pieces.

    Guarantees: the ``k`` chunks tile ``[0, n)`` in order; sizes are non-increasing; the chunk
    is empty iff ``i * ceil(n/k) >= n`` (``property_tests/test_layout_properties.py::
    test_one_axis_shards_match_torch_chunk_and_dtensor_split``)."""
    if k < 1 or not 0 <= i < k or n < 0:
        raise ValueError(f"chunk {i} of {k} of a dim of size {n} is undefined")
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def chunk(t: Tensor, k: int, dim: int) -> list[Tensor]:
    """``torch.chunk(t, k, dim)`` padded with empty views to exactly ``k`` pieces (views)."""
    n = t.shape[dim]
    return [t.narrow(dim, s, e - s) for s, e in (chunk_bounds(n, k, i) for i in range(k))]


def chunks_nest(n: int, outer: int, inner: int) -> bool:
    """Does cutting ``[0, n)`` into ``outer`` chunks, then each into ``inner``, give the same
    pieces (in the same order) as cutting it into ``outer * inner`` chunks directly?

    True whenever ``outer == 1`` or ``inner == 1``, or both divide evenly; false for e.g.
    ``n=5, outer=2, inner=2`` (nested ``2,1,1,1`` vs flat ``2,2,1,0``)."""
    for i in range(outer):
        s, e = chunk_bounds(n, outer, i)
        for j in range(inner):
            a, b = chunk_bounds(e - s, inner, j)
            if (s + a, s + b) != chunk_bounds(n, outer * inner, i * inner + j):
                return False
    return True


def local_box(shape: Sequence[int], spec: Spec, mesh: Mesh, rank: int) -> Box:
    """The global ``[start, stop)`` range, per dim, of the block ``rank`` holds.

    Guarantees: for fixed ``(shape, spec, mesh)`` the distinct boxes tile the tensor exactly
    (disjoint, covering), ranks differing only on replicated or partial axes get the same box,
    and rank 0 holds the largest block (``test_local_boxes_tile_the_tensor_exactly``)."""
    spec.validate(mesh, shape)
    return tuple(
        chunk_bounds(n, mesh.axis_size(spec.axes(d)), mesh.index(rank, spec.axes(d)))
        for d, n in enumerate(shape)
    )


def local_shape(shape: Sequence[int], spec: Spec, mesh: Mesh, rank: int) -> tuple[int, ...]:
    return tuple(e - s for s, e in local_box(shape, spec, mesh, rank))


def padded_local_shape(shape: Sequence[int], spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    """Every rank's block padded to the full chunk ``ceil(n/k)`` on each sharded dim: the
    equal-size buffer a real collective moves. Equals rank 0's local shape (chunk 0 is the
    largest), and is the max over ranks dim by dim."""
    spec.validate(mesh, shape)
    return tuple(-(-n // mesh.axis_size(spec.axes(d))) for d, n in enumerate(shape))


def _block(t: Tensor, box: Box) -> Tensor:
    for d, (s, e) in enumerate(box):
        t = t.narrow(d, s, e - s)
    return t


def _holds_partial_value(spec: Spec, mesh: Mesh, rank: int) -> bool:
    c = mesh.coords(rank)
    return all(c[a] == 0 for a in spec.partial)


def shard(tensor: Tensor, spec: Spec, mesh: Mesh) -> list[Tensor]:
    """Split a global tensor into one local tensor per rank (index = rank).

    Guarantees:
      * ``unshard(shard(t, s, m), s, m)`` equals ``t`` bit for bit
        (``property_tests/test_layout_properties.py::test_unshard_inverts_shard_for_any_spec_and_mesh``).
      * ``shard(t)[r].shape`` is the shape of ``local_box(t.shape, s, m, r)``.
      * Partial axes: the rank with coordinate 0 on every partial axis holds the block, the
        others hold zeros of the same shape, so the sum over the partial group is the block.

    Non-partial locals are views of ``tensor`` (no copy); the zeros are fresh tensors.
    """
    spec.validate(mesh, tuple(tensor.shape))
    out = []
    for r in range(mesh.size):
        block = _block(tensor, local_box(tuple(tensor.shape), spec, mesh, r))
        out.append(block if _holds_partial_value(spec, mesh, r) else torch.zeros_like(block))
    return out


def global_shape(locals_: Sequence[Tensor], spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    """The global shape implied by per-rank blocks: along each dim, the sum of the block sizes
    of the ranks in rank 0's group over that dim's axes."""
    if len(locals_) != mesh.size:
        raise ValueError(f"expected one local tensor per rank of {mesh} ({mesh.size}), got {len(locals_)}")
    if spec.ndim != locals_[0].dim():
        raise ValueError(f"{spec} has {spec.ndim} dims but the local tensors have {locals_[0].dim()}")
    spec.validate_axes(mesh)
    return tuple(sum(locals_[r].shape[d] for r in mesh.groups(spec.axes(d))[0]) for d in range(spec.ndim))


def unshard(locals_: Sequence[Tensor], spec: Spec, mesh: Mesh, *, check_replicas: bool = True) -> Tensor:
    """Assemble the global tensor from one local tensor per rank.

    Guarantees:
      * Inverse of ``shard`` (see there); the global shape is inferred, and every local's shape
        must equal its ``local_box`` for that shape, else ``ValueError`` naming the rank.
      * Partial axes are summed in increasing rank order (deterministic; starts from exact
        zeros, so a single contribution is copied bit for bit).
      * Replicated axes: the copy on the rank with coordinate 0 on every replicated axis is
        used; with ``check_replicas`` every other copy must be EQUAL to it (``torch.equal``),
        else ``ValueError`` naming both ranks -- replicas drifting apart is always a bug.

    Edge cases: 0-d tensors, 0-size dims and empty shards all work; dtype is kept.
    """
    shape = global_shape(locals_, spec, mesh)
    spec.validate(mesh, shape)
    replicated = spec.replicated_axes(mesh)
    out = torch.zeros(shape, dtype=locals_[0].dtype, device=locals_[0].device)
    first_copy: dict[tuple[int, Box], int] = {}
    for r in range(mesh.size):
        box = local_box(shape, spec, mesh, r)
        if tuple(locals_[r].shape) != tuple(e - s for s, e in box):
            raise ValueError(
                f"rank {r} holds shape {tuple(locals_[r].shape)} but {spec} of {shape} on {mesh} gives box {box}"
            )
        c = mesh.coords(r)
        if all(c[a] == 0 for a in replicated):
            view = _block(out, box)
            view.copy_(view + locals_[r])
            first_copy[(mesh.index(r, spec.partial), box)] = r
        elif check_replicas:
            twin = first_copy[(mesh.index(r, spec.partial), box)]
            if not torch.equal(locals_[r], locals_[twin]):
                raise ValueError(f"replicas disagree under {spec}: rank {r} differs from rank {twin}")
    return out
