"""Collectives as values, the planner that chains them, their byte costs and their adjoints.

A ``Collective`` is one step that turns a tensor laid out as ``src`` into the same GLOBAL value
laid out as ``dst`` (``dst`` is derived from the step, never given). Kinds, on mesh ``axes``
(a group: ranks that differ only along those axes, ordered by their combined index):

=================  ==================================================  ==================
kind               layout change (``e`` = the dim's axes before)        adjoint
=================  ==================================================  ==================
``all_gather``     dim ``d``: ``e + axes`` -> ``e``                      ``reduce_scatter``
``reduce_scatter`` partial ``axes`` -> dim ``d``: ``e`` -> ``e + axes``  ``all_gather``
``all_reduce``     partial ``axes`` -> replicated                        ``all_reduce``
``all_to_all``     ``axes`` move from the end of dim ``d1`` to the end   ``all_to_all``
                   of dim ``d2``; ``dims == (d1, d2)``                    ``(d2, d1)``
``local_slice``    replicated ``axes`` -> dim ``d``: ``e`` -> ``e+axes``  ``local_pad``
                   (no communication)
``local_pad``      dim ``d``: ``e + axes`` -> ``e``, ``axes`` partial:   ``local_slice``
                   each rank writes its block into zeros (no communication)
=================  ==================================================  ==================

Each rank acts on its own block with ``torch.chunk`` semantics (``fsdpx.sharding.layout``), so a step is
only valid when the chunks of the dim NEST (``layout.chunks_nest``); always true when ``e`` is
empty or sizes divide. ``Collective`` refuses other steps, and ``plan`` routes around them.

Byte conventions (per rank, ``itemsize`` from ``dtype``). ``B`` is the rank's input block padded
to the full chunk ``ceil(n/k)`` on every sharded dim (``layout.padded_local_shape``): the
equal-size buffer NCCL-style collectives need, and the worst rank's block. ``k`` = group size.

=================  ======================  ===========================  ====================
kind               ``buffer_bytes``        ``send_bytes`` (= recv)      algorithm
=================  ======================  ===========================  ====================
``all_gather``     ``k*B`` (the output)    ``(k-1)*B``                  ring
``reduce_scatter`` ``k*C`` (the input)     ``(k-1)*C``                  ring
``all_reduce``     ``B``                   ``2*(k-1)*ceil(B/k)``        ring (RS + AG)
``all_to_all``     ``B`` (input, ``d2``    ``(k-1)*B/k``                pairwise
                   padded to ``k`` chunks)
``local_*``        ``0``                   ``0``
=================  ======================  ===========================  ====================

For reduce_scatter ``C`` is the padded output chunk: ``B`` with dim ``d`` cut to
``ceil(B_d / k)``. All_reduce runs a ring over ``k`` chunks of ``ceil(B/k)`` elements.

``buffer_bytes`` is the convention of torch's comm debug counters (the tensor handed to the
collective); a group of size 1 still counts its buffer, with zero sent.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from .layout import chunks_nest, padded_local_shape
from .mesh import Axes, Mesh, as_axes
from .spec import Spec

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "local_slice", "local_pad")
_ADJOINT_KIND = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "local_slice": "local_pad",
    "local_pad": "local_slice",
}
_NUM_DIMS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0, "all_to_all": 2, "local_slice": 1, "local_pad": 1}


@dataclass(frozen=True)
class Collective:
    """One layout-changing step on one tensor (see the module table).

    Fields given: ``kind``, ``axes`` (the group), ``dims`` (``()`` for all_reduce, ``(d,)``,
    or ``(d1, d2)`` for all_to_all), ``src`` (layout before), ``shape`` (global), ``mesh``,
    ``dtype``. Fields derived: ``dst`` (layout after), ``send_bytes``, ``recv_bytes``,
    ``buffer_bytes`` (per rank, see the module table).

    Guarantees:
      * Construction validates the step (``ValueError`` naming the axis or dim otherwise):
        ``src`` fits ``mesh`` and ``shape``; gathered axes are the minor end of the dim's entry;
        reduced axes are partial; sliced axes are replicated; chunks nest.
      * Executing it preserves the global value: ``unshard(run(c, x), c.dst) ==
        unshard(x, c.src)`` (``property_tests/test_collective_properties.py::
        test_executing_a_plan_preserves_the_global_value``).
    """

    kind: str
    axes: tuple[str, ...]
    dims: tuple[int, ...]
    src: Spec
    shape: tuple[int, ...]
    mesh: Mesh
    dtype: torch.dtype = torch.float32
    dst: Spec = field(init=False)
    send_bytes: int = field(init=False)
    recv_bytes: int = field(init=False)
    buffer_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", as_axes(self.axes))
        object.__setattr__(self, "dims", tuple(self.dims))
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}; kinds are {KINDS}")
        if len(self.dims) != _NUM_DIMS[self.kind]:
            raise ValueError(f"{self.kind} takes {_NUM_DIMS[self.kind]} tensor dims, got {self.dims}")
        if not self.axes:
            raise ValueError(f"{self.kind} needs at least one mesh axis")
        self.mesh.check_axes(self.axes)
        self.src.validate(self.mesh, self.shape)
        for d in self.dims:
            if not 0 <= d < len(self.shape):
                raise ValueError(f"{self.kind}: dim {d} out of range for shape {self.shape}")
        object.__setattr__(self, "dst", _apply(self))
        send, buffer = _bytes(self)
        object.__setattr__(self, "send_bytes", send)
        object.__setattr__(self, "recv_bytes", send)
        object.__setattr__(self, "buffer_bytes", buffer)

    @property
    def group_size(self) -> int:
        return self.mesh.axis_size(self.axes)

    def __str__(self) -> str:
        return (
            f"{self.kind}[{','.join(self.axes)}; dims {self.dims}] {self.src} -> {self.dst}"
            f" ({self.buffer_bytes} B buffer, {self.send_bytes} B sent per rank)"
        )


# ---- what a step does to the layout ----------------------------------------------------------


def _require_nest(c: Collective, d: int, outer: Sequence[str]) -> None:
    n, k_out, k_in = c.shape[d], c.mesh.axis_size(outer), c.mesh.axis_size(c.axes)
    if not chunks_nest(n, k_out, k_in):
        raise ValueError(
            f"{c.kind} over {c.axes} on dim {d}: a dim of size {n} cut into {k_out} chunks, then"
            f" {k_in}, does not match cutting it into {k_out * k_in}; go through the replicated layout"
        )


def _drop_suffix(c: Collective, d: int) -> tuple[str, ...]:
    e = c.src.axes(d)
    if e[len(e) - len(c.axes):] != c.axes:
        raise ValueError(f"{c.kind}: axes {c.axes} are not the minor end of dim {d} in {c.src}")
    return e[: len(e) - len(c.axes)]


def _respec(src: Spec, dims: dict[int, tuple[str, ...]], partial: Iterable[str]) -> Spec:
    entries = [dims.get(d, src.axes(d)) for d in range(src.ndim)]
    return Spec(*entries, partial=tuple(partial))


def _apply(c: Collective) -> Spec:
    src, axes = c.src, c.axes
    if c.kind in ("reduce_scatter", "all_reduce"):
        missing = [a for a in axes if a not in src.partial]
        if missing:
            raise ValueError(f"{c.kind}: axis {missing[0]!r} is not partial in {src}")
    rest = [a for a in src.partial if a not in axes]
    if c.kind == "all_reduce":
        return src.with_partial(rest)
    if c.kind in ("reduce_scatter", "local_slice"):
        (d,) = c.dims
        if c.kind == "local_slice":
            not_repl = [a for a in axes if a not in src.replicated_axes(c.mesh)]
            if not_repl:
                raise ValueError(f"local_slice: axis {not_repl[0]!r} is not replicated in {src}")
        _require_nest(c, d, src.axes(d))
        return _respec(src, {d: src.axes(d) + axes}, rest)
    if c.kind in ("all_gather", "local_pad"):
        (d,) = c.dims
        kept = _drop_suffix(c, d)
        _require_nest(c, d, kept)
        return _respec(src, {d: kept}, src.partial + (axes if c.kind == "local_pad" else ()))
    d1, d2 = c.dims  # all_to_all
    if d1 == d2:
        raise ValueError(f"all_to_all needs two different dims, got {c.dims}")
    kept = _drop_suffix(c, d1)
    _require_nest(c, d1, kept)
    _require_nest(c, d2, src.axes(d2))
    return _respec(src, {d1: kept, d2: src.axes(d2) + axes}, src.partial)


def _bytes(c: Collective) -> tuple[int, int]:
    """``(send_bytes, buffer_bytes)`` per rank; recv equals send for every kind here."""
    if c.kind in ("local_slice", "local_pad"):
        return 0, 0
    k, item = c.group_size, c.dtype.itemsize
    padded = list(padded_local_shape(c.shape, c.src, c.mesh))
    block = math.prod(padded)
    if c.kind == "all_gather":
        return (k - 1) * block * item, k * block * item
    if c.kind == "all_reduce":
        return 2 * (k - 1) * -(-block // k) * item, block * item
    d = c.dims[0] if c.kind == "reduce_scatter" else c.dims[1]
    padded[d] = k * -(-padded[d] // k)
    block = math.prod(padded)  # a multiple of k
    return (k - 1) * (block // k) * item, block * item


# ---- planning --------------------------------------------------------------------------------


def plan(
    src: Spec, dst: Spec, shape: Sequence[int], mesh: Mesh, dtype: torch.dtype = torch.float32
) -> list[Collective]:
    """The collectives that turn a tensor of ``shape`` laid out as ``src`` into ``dst``.

    Order: (1) reduce the partial axes ``dst`` does not keep -- ``reduce_scatter`` onto the dim
    ``dst`` shards with them when that dim is ready, one combined ``all_reduce`` for the rest;
    reducing first keeps later steps small, and HSDP's reduce-scatter-then-all-reduce falls out.
    (2) ``all_gather`` the axes each dim must lose (the whole entry if uneven chunks would not
    nest), pairing a loss on one dim with a gain on another as an ``all_to_all`` when possible.
    (3) ``local_slice`` the axes each dim must gain.

    Guarantees:
      * ``plan(s, s, ...) == []``; every step is a valid ``Collective``, chained (``c[i].dst ==
        c[i+1].src``), from ``src`` to ``dst``
        (``property_tests/test_collective_properties.py::test_plan_chains_from_src_to_dst``).
      * Executing the plan preserves the global value (``test_executing_a_plan_preserves_the_global_value``).
      * Single-axis transitions use the one cheapest collective: gather (AG), reduce to a shard
        (RS), reduce (AR), reshard to another dim (A2A), shard a replica (slice, no bytes).
        Compound changes are correct but not proven minimal.

    Raises ``ValueError`` if either spec does not fit (see ``Spec.validate``) or ``dst`` has a
    partial axis ``src`` lacks: a value becomes unreduced by computation, not communication.
    """
    shape = tuple(shape)
    src.validate(mesh, shape)
    dst.validate(mesh, shape)
    new_partial = [a for a in dst.partial if a not in src.partial]
    if new_partial:
        raise ValueError(f"cannot plan {src} -> {dst}: axis {new_partial[0]!r} would become partial")
    steps: list[Collective] = []

    def emit(kind: str, axes: Axes, dims: tuple[int, ...]) -> None:
        steps.append(Collective(kind, as_axes(axes), dims, steps[-1].dst if steps else src, shape, mesh, dtype))

    def cur() -> Spec:
        return steps[-1].dst if steps else src

    def nests(d: int, outer: Sequence[str], inner: Sequence[str]) -> bool:
        return chunks_nest(shape[d], mesh.axis_size(outer), mesh.axis_size(inner))

    # (1) reductions
    progress = True
    while progress:
        progress = False
        for d in range(len(shape)):
            e, f = cur().axes(d), dst.axes(d)
            if f[: len(e)] != e:
                continue
            run = []
            for a in f[len(e):]:
                if a not in cur().partial:
                    break
                run.append(a)
            while run and not nests(d, e, run):
                run.pop()
            if run:
                emit("reduce_scatter", tuple(run), (d,))
                progress = True
    leftover = [a for a in mesh.axis_names if a in cur().partial and a not in dst.partial]
    if leftover:
        emit("all_reduce", tuple(leftover), ())

    # (2) removals, some paired into all_to_all
    keep: dict[int, tuple[str, ...]] = {}
    for d in range(len(shape)):
        e, f = cur().axes(d), dst.axes(d)
        p = 0
        while p < min(len(e), len(f)) and e[p] == f[p]:
            p += 1
        keep[d] = e[:p] if nests(d, e[:p], e[p:]) else ()
    lose = {d: cur().axes(d)[len(keep[d]):] for d in keep}
    pairs: dict[int, int] = {}
    for d1 in keep:
        for d2 in keep:
            r, e2 = lose[d1], cur().axes(d2)
            gain = dst.axes(d2)[len(e2): len(e2) + len(r)]
            if (r and d2 != d1 and not lose[d2] and d2 not in pairs.values() and d1 not in pairs
                    and gain == r and nests(d2, e2, r)):
                pairs[d1] = d2
    for d in keep:
        if lose[d] and d not in pairs:
            emit("all_gather", lose[d], (d,))
    for d1, d2 in pairs.items():
        emit("all_to_all", lose[d1], (d1, d2))

    # (3) additions
    for d in range(len(shape)):
        e, f = cur().axes(d), dst.axes(d)
        if e == f:
            continue
        if not nests(d, e, f[len(e):]):
            emit("all_gather", e, (d,))
            e = ()
        emit("local_slice", f[len(e):], (d,))

    if cur() != dst:  # pragma: no cover - a planner bug, caught by the property tests
        raise AssertionError(f"plan {src} -> {dst} ended at {cur()}")
    return steps


@functools.lru_cache(maxsize=8192)
def cached_plan(src: Spec, dst: Spec, shape: tuple[int, ...], mesh: Mesh,
                dtype: torch.dtype = torch.float32) -> tuple[Collective, ...]:
    """:func:`plan` as an immutable tuple, memoised: a runtime plans each parameter's layout
    changes once per run instead of once per step (every argument is a hashable value)."""
    return tuple(plan(src, dst, shape, mesh, dtype))


def cost(collectives: Iterable[Collective]) -> dict[str, int]:
    """Bytes per rank: ``{kind: sum of buffer_bytes}`` for every kind present, plus
    ``'send_bytes'`` and ``'recv_bytes'`` totals. ``cost([]) == {'send_bytes': 0, 'recv_bytes': 0}``.

    The same dict shape as ``SimulatedMesh.counts``, which counts bytes from the tensors it
    actually moves (``test_counted_bytes_equal_cost_of_plan``)."""
    out: dict[str, int] = {}
    send = recv = 0
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.buffer_bytes
        send += c.send_bytes
        recv += c.recv_bytes
    out["send_bytes"], out["recv_bytes"] = send, recv
    return out


def adjoint(c: Collective) -> Collective:
    """The transpose of ``c`` as a linear map on per-rank lists: what the backward pass runs.

    It maps cotangents laid out as ``c.dst.dual(mesh)`` to ``c.src.dual(mesh)`` (``Spec.dual``
    swaps replicated and partial axes): the backward of gathering parameters is reduce-scattering
    their per-rank gradients.

    Guarantees (``property_tests/test_collective_properties.py::test_adjoint_satisfies_inner_product_identity``):
      * With ``<x, y> = sum over ranks r of dot(x[r], y[r])`` -- every rank's block counted,
        replicas included, no weights -- ``<c(x), y> == <x, adjoint(c)(y)>`` for ALL per-rank
        lists of the right local shapes (not only consistent ones).
      * For ``x`` laid out as ``S`` and ``y`` as ``S.dual(mesh)`` that pairing equals the dot
        product of the two global values, so the identity is also one between global values.
      * ``adjoint(adjoint(c)) == c``.
    """
    dims = c.dims[::-1] if c.kind == "all_to_all" else c.dims
    return Collective(_ADJOINT_KIND[c.kind], c.axes, dims, c.dst.dual(c.mesh), c.shape, c.mesh, c.dtype)
