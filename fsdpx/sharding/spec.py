"""How one tensor is laid out on a mesh: a ``Spec``, in the style of JAX's ``PartitionSpec``.

``Spec('dp', None)`` -- dim 0 split over mesh axis ``dp``, dim 1 whole; every other mesh axis
holds copies (replicated). ``Spec(('replica', 'shard'), None)`` splits dim 0 over both axes,
``replica`` major. ``Spec(None, partial=('dp',))`` is an UNREDUCED value: the global tensor is
the sum over ``dp`` of the local tensors (a gradient before its all-reduce).

Every mesh axis therefore plays exactly one role for a tensor: it shards one dim, it is a
partial (summed) axis, or it is replicated. How a sharded dim is cut (``torch.chunk``
semantics) lives in ``fsdpx.sharding.layout``.
"""

from __future__ import annotations

import ast
from typing import Iterable, Iterator, Optional, Sequence, Union

from .mesh import Mesh, as_axes

Entry = Optional[Union[str, tuple[str, ...]]]


def _canonical_entry(entry: object) -> Entry:
    if entry is None:
        return None
    if isinstance(entry, str):
        if not entry:
            raise ValueError("a mesh axis name cannot be the empty string")
        return entry
    if isinstance(entry, (tuple, list)):
        names = tuple(entry)
        for a in names:
            if not isinstance(a, str) or not a:
                raise ValueError(f"spec entry {entry!r}: axis names must be non-empty strings")
        if not names:
            return None
        return names[0] if len(names) == 1 else names
    raise ValueError(f"spec entry {entry!r} must be None, an axis name or a tuple of axis names")


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


def _check_no_repeats(used: Sequence[str], where: str) -> None:
    seen: set[str] = set()
    for a in used:
        if a in seen:
            raise ValueError(f"mesh axis {a!r} used twice in {where}")
        seen.add(a)


class Spec:
    """One entry per tensor dim (``None``, an axis name, or a tuple of axis names major to
    minor) plus the set of ``partial`` axes.

    Guarantees:
      * Canonical at construction, so equal layouts compare and hash equal: a 1-tuple entry
        becomes the name, an empty tuple or list becomes ``None``, lists become tuples, and
        ``partial`` (a set: the order of a sum does not change its value) is stored sorted.
      * ``Spec.parse(repr(s)) == s`` (``tests/test_spec.py::test_parse_inverts_repr``).
      * No axis appears twice across the dims and ``partial``: ``ValueError`` naming it, already
        at construction since no mesh can make such a spec meaningful.
      * ``validate(mesh, shape)`` additionally rejects axes not on the mesh and a dim count
        different from ``len(shape)`` (``tests/test_spec.py``).

    Edge cases:
      ===============================  ==============================================
      ``Spec()``                        a 0-d tensor (a scalar), replicated
      ``Spec(None, partial=('dp',))``   unreduced over ``dp``, otherwise replicated
      an axis of size 1 in an entry     allowed; the "shard" is the whole dim
      a dim smaller than its shards     allowed; trailing ranks hold empty shards
      ===============================  ==============================================
    """

    __slots__ = ("_dims", "_partial")
    _dims: tuple[Entry, ...]
    _partial: tuple[str, ...]

    def __init__(self, *dims: object, partial: str | Iterable[str] = ()) -> None:
        canon = tuple(_canonical_entry(e) for e in dims)
        part = (partial,) if isinstance(partial, str) else tuple(partial)
        for a in part:
            if not isinstance(a, str) or not a:
                raise ValueError(f"partial axes must be non-empty strings, got {a!r}")
        used = [a for e in canon for a in _entry_axes(e)] + list(part)
        _check_no_repeats(used, f"dims {canon} and partial {part}")
        object.__setattr__(self, "_dims", canon)
        object.__setattr__(self, "_partial", tuple(sorted(part)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Spec is immutable")

    @classmethod
    def replicated(cls, ndim: int) -> "Spec":
        """The fully replicated layout of an ``ndim``-dimensional tensor."""
        if ndim < 0:
            raise ValueError(f"ndim must be >= 0, got {ndim}")
        return cls(*([None] * ndim))

    @classmethod
    def parse(cls, text: str) -> "Spec":
        """Read back ``repr(spec)``: ``"Spec('dp', None, partial=('tp',))"``. Only literals are
        evaluated; anything else is a ``ValueError``."""
        try:
            node = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as e:
            raise ValueError(f"cannot parse spec {text!r}: {e.msg}") from None
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Spec"):
            raise ValueError(f"cannot parse spec {text!r}: expected Spec(...)")
        try:
            dims = [ast.literal_eval(a) for a in node.args]
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            raise ValueError(f"cannot parse spec {text!r}: entries must be literals") from None
        if set(kw) - {"partial"}:
            raise ValueError(f"cannot parse spec {text!r}: unknown keyword {sorted(set(kw) - {'partial'})}")
        return cls(*dims, partial=kw.get("partial", ()))

    # ---- reading ---------------------------------------------------------------------------

    @property
    def dims(self) -> tuple[Entry, ...]:
        return self._dims

    @property
    def partial(self) -> tuple[str, ...]:
        return self._partial

    @property
    def ndim(self) -> int:
        return len(self._dims)

    def axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes dim ``dim`` is split over, major to minor (``()`` if whole)."""
        return _entry_axes(self._dims[dim])

    @property
    def sharding_axes(self) -> tuple[str, ...]:
        """Every axis that splits some dim, in dim order."""
        return tuple(a for e in self._dims for a in _entry_axes(e))

    def replicated_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """Mesh axes that neither split a dim nor are partial: the value is copied along them."""
        used = set(self.sharding_axes) | set(self._partial)
        return tuple(a for a in mesh.axis_names if a not in used)

    # ---- building --------------------------------------------------------------------------

    def with_dim(self, dim: int, axes: str | Iterable[str]) -> "Spec":
        """This spec with dim ``dim`` split over ``axes`` (a name or names) instead."""
        dims = list(self._dims)
        dims[dim] = as_axes(axes)
        return Spec(*dims, partial=self._partial)

    def with_partial(self, partial: str | Iterable[str]) -> "Spec":
        """This spec with exactly the partial axes ``partial`` (a name or names)."""
        return Spec(*self._dims, partial=as_axes(partial))

    def dual(self, mesh: Mesh) -> "Spec":
        """The layout of a cotangent (gradient) of a value laid out as ``self``: same dims, with
        replicated and partial axes swapped. The gradient of a value copied along an axis is a
        sum of per-rank contributions along it, and conversely. ``dual(dual(s)) == s``.

        It is the layout pairing that makes ``sum over ranks of <x_r, y_r>`` equal to the
        inner product of the global values (``fsdpx.sharding.collectives.adjoint``)."""
        self.validate_axes(mesh)
        return Spec(*self._dims, partial=self.replicated_axes(mesh))

    # ---- checking --------------------------------------------------------------------------

    def validate_axes(self, mesh: Mesh) -> None:
        """Every axis used must be a mesh axis (``ValueError`` naming it)."""
        for a in self.sharding_axes + self._partial:
            if a not in mesh.axis_names:
                raise ValueError(f"unknown mesh axis {a!r} in {self}; {mesh} has axes {mesh.axis_names}")

    def validate(self, mesh: Mesh, shape: Sequence[int]) -> "Spec":
        """Check this spec can lay out a tensor of ``shape`` on ``mesh``; return ``self``."""
        self.validate_axes(mesh)
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise ValueError(f"{self} has {self.ndim} dims but shape {shape} has {len(shape)}")
        for n in shape:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"shape {shape} must hold non-negative ints")
        return self

    # ---- value semantics -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    def __getitem__(self, dim: int) -> Entry:
        return self._dims[dim]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and (self._dims, self._partial) == (other._dims, other._partial)

    def __hash__(self) -> int:
        return hash(("Spec", self._dims, self._partial))

    def __repr__(self) -> str:
        parts = [repr(e) for e in self._dims]
        if self._partial:
            parts.append(f"partial={self._partial!r}")
        return "Spec(" + ", ".join(parts) + ")"
