"""Run collectives on a list of per-rank tensors (index = rank), in one process.

The reference executor for ``fsdpx.sharding.collectives``: the planner's claims (global value preserved,
bytes as costed) are checked against what this class does to real tensors, and a later
``torch.distributed`` runtime is checked against this class.

Semantics of every primitive, per group of ``mesh.groups(axes)`` (ranks ordered by their
combined index over ``axes``):

* ``all_gather(x, axes, dim)``: every member gets ``cat(x[g0], x[g1], ..., dim)``.
* ``reduce_scatter(x, axes, dim)``: ``s = x[g0] + x[g1] + ...`` (left to right), member ``j``
  gets chunk ``j`` of ``s`` (``layout.chunk``: torch.chunk padded with empty chunks).
* ``all_reduce(x, axes)``: every member gets ``s``, the same left-to-right sum.
* ``all_to_all(x, axes, split_dim, concat_dim)``: member ``i`` gets
  ``cat(chunk_i(x[g0], split_dim), chunk_i(x[g1], split_dim), ..., concat_dim)``.
* ``broadcast(x, axes, src=0)``: every member gets a copy of member ``src``'s tensor.
* ``local_slice(x, axes, dim)``: member ``j`` keeps chunk ``j`` of its own tensor.
* ``local_pad(x, axes, dim)``: member ``j`` places its tensor at chunk ``j`` of zeros ``k``
  times as long along ``dim`` (minus the padding of empty trailing chunks): the transpose of
  ``local_slice``.

Guarantees: sums run in rank-group order, so results are bit-reproducible; every rank receives
its own tensor (no aliasing between ranks or with the inputs); inputs are never modified.

Byte counting: ``counts`` has the shape of ``collectives.cost`` and is computed from the
tensors actually moved (group by group, the worst group): inputs padded to equal size along
the collective's dim, exactly the per-rank conventions of ``fsdpx.sharding.collectives``. Broadcast
counts ``buffer = send = recv = B`` (pipelined chain).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence, Union

import torch
from torch import Tensor

from .collectives import Collective
from .layout import chunk, chunk_bounds, local_shape
from .mesh import Axes, Mesh, as_axes

Locals = list[Tensor]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _sum(xs: Sequence[Tensor]) -> Tensor:
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


class SimulatedMesh:
    """A ``Mesh`` whose ranks are the entries of a Python list. See the module docstring."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._counts: dict[str, int] = {}
        self.reset_counts()

    # ---- counters -------------------------------------------------------------------------

    @property
    def counts(self) -> dict[str, int]:
        """Bytes per rank so far: ``{kind: buffer bytes, 'send_bytes': .., 'recv_bytes': ..}``."""
        return dict(self._counts)

    def reset_counts(self) -> None:
        self._counts = {"send_bytes": 0, "recv_bytes": 0}

    def add_counts(self, counts: dict[str, int]) -> None:
        """Add another mesh's counts (a sub-mesh's collective run by one group) to these."""
        for k, v in counts.items():
            self._counts[k] = self._counts.get(k, 0) + v

    def _count(self, kind: str, per_group: Iterable[tuple[int, int]], itemsize: int) -> None:
        tally = list(per_group)
        send = max((s for s, _ in tally), default=0)
        buffer = max((b for _, b in tally), default=0)
        self._counts[kind] = self._counts.get(kind, 0) + buffer * itemsize
        self._counts["send_bytes"] += send * itemsize
        self._counts["recv_bytes"] += send * itemsize

    # ---- plumbing --------------------------------------------------------------------------

    def _groups(self, xs: Sequence[Tensor], axes: Axes) -> tuple[tuple[str, ...], list[list[int]]]:
        if len(xs) != self.mesh.size:
            raise ValueError(f"expected one tensor per rank of {self.mesh} ({self.mesh.size}), got {len(xs)}")
        names = as_axes(axes)
        if not names:
            raise ValueError("a collective needs at least one mesh axis")
        return names, self.mesh.groups(names)

    @staticmethod
    def _same_shapes(xs: Sequence[Tensor], group: list[int], what: str, skip: int | None = None) -> None:
        def key(t: Tensor) -> tuple[int, ...]:
            return tuple(n for d, n in enumerate(t.shape) if d != skip)

        shapes = {key(xs[r]) for r in group}
        if len(shapes) > 1:
            raise ValueError(f"{what}: ranks {group} hold incompatible shapes {[tuple(xs[r].shape) for r in group]}")

    # ---- primitives ------------------------------------------------------------------------

    def all_gather(self, xs: Sequence[Tensor], axes: Axes, dim: int) -> Locals:
        _, groups = self._groups(xs, axes)
        out: list[Tensor] = list(xs)
        tally = []
        for g in groups:
            self._same_shapes(xs, g, "all_gather", skip=dim)
            full = torch.cat([xs[r] for r in g], dim)
            for r in g:
                out[r] = full.clone()
            block = max(xs[r].shape[dim] for r in g) * math.prod(n for d, n in enumerate(xs[g[0]].shape) if d != dim)
            tally.append(((len(g) - 1) * block, len(g) * block))
        self._count("all_gather", tally, xs[0].element_size())
        return out

    def reduce_scatter(self, xs: Sequence[Tensor], axes: Axes, dim: int) -> Locals:
        _, groups = self._groups(xs, axes)
        out: list[Tensor] = list(xs)
        tally = []
        for g in groups:
            self._same_shapes(xs, g, "reduce_scatter")
            k = len(g)
            pieces = chunk(_sum([xs[r] for r in g]), k, dim)
            for j, r in enumerate(g):
                out[r] = pieces[j].clone()
            shape = list(xs[g[0]].shape)
            shape[dim] = _ceil(shape[dim], k)
            piece = math.prod(shape)
            tally.append(((k - 1) * piece, k * piece))
        self._count("reduce_scatter", tally, xs[0].element_size())
        return out

    def all_reduce(self, xs: Sequence[Tensor], axes: Axes) -> Locals:
        _, groups = self._groups(xs, axes)
        out: list[Tensor] = list(xs)
        tally = []
        for g in groups:
            self._same_shapes(xs, g, "all_reduce")
            total = _sum([xs[r] for r in g])
            for r in g:
                out[r] = total.clone()
            k, block = len(g), xs[g[0]].numel()
            tally.append((2 * (k - 1) * _ceil(block, k), block))
        self._count("all_reduce", tally, xs[0].element_size())
        return out

    def all_to_all(self, xs: Sequence[Tensor], axes: Axes, split_dim: int, concat_dim: int) -> Locals:
        _, groups = self._groups(xs, axes)
        if split_dim == concat_dim:
            raise ValueError(f"all_to_all needs split_dim != concat_dim, got {split_dim}")
        out: list[Tensor] = list(xs)
        tally = []
        for g in groups:
            self._same_shapes(xs, g, "all_to_all", skip=concat_dim)
            k = len(g)
            pieces = [chunk(xs[r], k, split_dim) for r in g]
            for i, r in enumerate(g):
                out[r] = torch.cat([pieces[j][i] for j in range(k)], concat_dim)
            shape = list(xs[g[0]].shape)
            shape[concat_dim] = max(xs[r].shape[concat_dim] for r in g)
            shape[split_dim] = k * _ceil(shape[split_dim], k)
            block = math.prod(shape)
            tally.append(((k - 1) * block // k, block))
        self._count("all_to_all", tally, xs[0].element_size())
        return out

    def broadcast(self, xs: Sequence[Tensor], axes: Axes, src: int = 0) -> Locals:
        _, groups = self._groups(xs, axes)
        out: list[Tensor] = list(xs)
        tally = []
        for g in groups:
            if not 0 <= src < len(g):
                raise ValueError(f"broadcast source index {src} out of range for a group of {len(g)}")
            for r in g:
                out[r] = xs[g[src]].clone()
            block = xs[g[src]].numel()
            tally.append((block if len(g) > 1 else 0, block))
        self._count("broadcast", tally, xs[0].element_size())
        return out

    def local_slice(self, xs: Sequence[Tensor], axes: Axes, dim: int) -> Locals:
        _, groups = self._groups(xs, axes)
        out: list[Tensor] = list(xs)
        for g in groups:
            for j, r in enumerate(g):
                out[r] = chunk(xs[r], len(g), dim)[j].clone()
        self._count("local_slice", [(0, 0)], xs[0].element_size())
        return out

    def local_pad(self, xs: Sequence[Tensor], axes: Axes, dim: int, size: Union[int, Sequence[int]]) -> Locals:
        """``size``: the length of ``dim`` after padding (the block before ``local_slice``), one
        int for all ranks or one per rank; it cannot be read off a rank's piece, which may be
        short or empty."""
        _, groups = self._groups(xs, axes)
        sizes = [size] * len(xs) if isinstance(size, int) else list(size)
        out: list[Tensor] = list(xs)
        for g in groups:
            for j, r in enumerate(g):
                s, e = chunk_bounds(sizes[r], len(g), j)
                if xs[r].shape[dim] != e - s:
                    raise ValueError(
                        f"local_pad: rank {r} holds {xs[r].shape[dim]} along dim {dim},"
                        f" chunk {j} of {sizes[r]} is {e - s}"
                    )
                shape = list(xs[r].shape)
                shape[dim] = sizes[r]
                full = xs[r].new_zeros(shape)
                full.narrow(dim, s, e - s).copy_(xs[r])
                out[r] = full
        self._count("local_pad", [(0, 0)], xs[0].element_size())
        return out

    # ---- collectives and plans -------------------------------------------------------------

    def run(self, step: Union[Collective, Iterable[Collective]], xs: Sequence[Tensor]) -> Locals:
        """Execute one ``Collective`` or a plan (a sequence of them) and return the new list.

        Checks ``step.mesh`` is this mesh and that every rank's tensor has its ``step.src``
        block shape (``ValueError`` naming the rank otherwise)."""
        if not isinstance(step, Collective):
            out = list(xs)
            for c in step:
                out = self.run(c, out)
            return out
        c = step
        if c.mesh != self.mesh:
            raise ValueError(f"collective for {c.mesh} run on {self.mesh}")
        if len(xs) != self.mesh.size:
            raise ValueError(f"expected one tensor per rank of {self.mesh} ({self.mesh.size}), got {len(xs)}")
        for r, x in enumerate(xs):
            want = local_shape(c.shape, c.src, c.mesh, r)
            if tuple(x.shape) != want:
                raise ValueError(f"rank {r} holds shape {tuple(x.shape)}, {c.src} of {c.shape} gives {want}")
        if c.kind == "all_reduce":
            return self.all_reduce(xs, c.axes)
        if c.kind == "all_to_all":
            d1, d2 = c.dims
            return self.all_to_all(xs, c.axes, split_dim=d2, concat_dim=d1)
        (d,) = c.dims
        if c.kind == "local_pad":
            sizes = [local_shape(c.shape, c.dst, c.mesh, r)[d] for r in range(self.mesh.size)]
            return self.local_pad(xs, c.axes, d, sizes)
        return getattr(self, c.kind)(xs, c.axes, d)
