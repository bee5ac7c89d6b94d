"""A device mesh as a value: named axes with sizes, ranks numbered row-major.

``Mesh(replica=2, shard=2)`` has four ranks; the LAST axis varies fastest::

    rank:     0  1  2  3
    replica:  0  0  1  1
    shard:    0  1  0  1

Everything here is pure arithmetic on integers; no process group is created. The same value
describes the mesh to the layout algebra (``fsdpx.sharding.layout``), the planner (``fsdpx.sharding.collectives``),
the simulated executor (``fsdpx.sharding.simulated``) and, later, a real ``torch.distributed`` runtime,
which must number its ranks the same way.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Union

Axes = Union[str, tuple[str, ...]]


def as_axes(axes: Axes | Iterable[str]) -> tuple[str, ...]:
    """``'dp'`` -> ``('dp',)``; a tuple or list of names -> that tuple (order kept)."""
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


class Mesh:
    """Named mesh axes with positive sizes, in major-to-minor order.

    Guarantees:
      * Immutable and hashable; ``Mesh(dp=2) == Mesh(dp=2)``, and axis ORDER matters
        (``Mesh(a=2, b=2) != Mesh(b=2, a=2)``): it fixes the rank numbering.
      * ``rank_of(coords(r)) == r`` for every rank, and ranks are row-major (last axis fastest)
        (``tests/test_mesh.py::test_rank_of_inverts_coords_row_major``).
      * ``groups(axes)`` partitions ``range(size)``; each group is ordered by the COMBINED index
        of its ranks over ``axes`` taken major to minor, exactly the index that picks a chunk
        when a tensor dim is sharded over the tuple ``axes`` (``fsdpx.sharding.layout``)
        (``tests/test_mesh.py::test_groups_partition_ranks_in_combined_index_order``).

    Edge cases:
      ============================  =====================================================
      ``Mesh()``                    one rank, no axes; every tensor is replicated on it
      an axis of size 1             allowed; collectives over it are no-ops that still count
      size 0, negative, non-int     ``ValueError`` naming the axis
      ``groups(())``                every rank alone: ``[[0], [1], ...]``
      unknown axis anywhere         ``ValueError`` naming it and the mesh's axes
      ============================  =====================================================
    """

    __slots__ = ("_axes",)
    _axes: tuple[tuple[str, int], ...]

    def __init__(self, **axes: int) -> None:
        for name, size in axes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} must have a positive int size, got {size!r}")
        object.__setattr__(self, "_axes", tuple(axes.items()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Mesh is immutable")

    # ---- shape -----------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._axes)

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` in major-to-minor order (a fresh dict)."""
        return dict(self._axes)

    @property
    def size(self) -> int:
        """Number of ranks: the product of the axis sizes (1 for ``Mesh()``)."""
        return math.prod(size for _, size in self._axes)

    def axis_size(self, axes: Axes | Iterable[str]) -> int:
        """Product of the sizes of ``axes`` (1 for ``()``); unknown axis -> ``ValueError``."""
        shape = self.shape
        self.check_axes(axes)
        return math.prod(shape[a] for a in as_axes(axes))

    def check_axes(self, axes: Axes | Iterable[str]) -> None:
        """Raise ``ValueError`` naming the first axis not on this mesh, or one listed twice."""
        names = as_axes(axes)
        for a in names:
            if a not in self.axis_names:
                raise ValueError(f"unknown mesh axis {a!r}; {self} has axes {self.axis_names}")
        for a in names:
            if names.count(a) > 1:
                raise ValueError(f"mesh axis {a!r} listed twice in {names}")

    # ---- ranks <-> coordinates -------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis (row-major, last axis fastest)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"rank {rank!r} out of range for {self} of size {self.size}")
        out: dict[str, int] = {}
        for name, size in reversed(self._axes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.axis_names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of ``coords``: needs exactly one in-range coordinate per axis."""
        if set(coords) != set(self.axis_names):
            raise ValueError(f"coordinates {dict(coords)} must name exactly the axes {self.axis_names}")
        rank = 0
        for name, size in self._axes:
            c = coords[name]
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c!r} out of range [0, {size})")
            rank = rank * size + c
        return rank

    def index(self, rank: int, axes: Axes | Iterable[str]) -> int:
        """Combined index of ``rank`` over ``axes`` taken major to minor (0 for ``()``).

        This is the position of ``rank`` in its group of ``groups(axes)``, and the chunk a rank
        holds of a dim sharded over ``axes``."""
        names = as_axes(axes)
        self.check_axes(names)
        c, shape = self.coords(rank), self.shape
        idx = 0
        for a in names:
            idx = idx * shape[a] + c[a]
        return idx

    def groups(self, axes: Axes | Iterable[str]) -> list[list[int]]:
        """The rank groups that differ only along ``axes``: the process groups of a collective
        over ``axes``. Groups are listed by their smallest rank; within a group, ranks are
        ordered by ``index(rank, axes)``."""
        names = as_axes(axes)
        self.check_axes(names)
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            rest = tuple(c[a] for a in self.axis_names if a not in names)
            by_rest.setdefault(rest, []).append(r)
        return [sorted(g, key=lambda r: self.index(r, names)) for g in by_rest.values()]

    # ---- sub-meshes -------------------------------------------------------------------------

    def sub(self, axes: Axes | Iterable[str]) -> "Mesh":
        """The mesh of ``axes`` alone (in this mesh's order): what one group of
        ``groups(axes)`` looks like to a collective that runs within it. Rank ``i`` of the
        sub-mesh is the member with ``index(rank, axes) == i``."""
        names = as_axes(axes)
        self.check_axes(names)
        shape = self.shape
        return Mesh(**{a: shape[a] for a in self.axis_names if a in names})

    def sub_axes(self, sub: "Mesh") -> tuple[str, ...]:
        """The axes of ``sub`` if it is ``self.sub(those axes)``; ``ValueError`` otherwise."""
        names = sub.axis_names
        if not names or self.sub(names) != sub:
            raise ValueError(f"{sub} is not a sub-mesh of {self}")
        return names

    # ---- value semantics -------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._axes == other._axes

    def __hash__(self) -> int:
        return hash(("Mesh", self._axes))

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self._axes) + ")"
