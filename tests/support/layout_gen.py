"""Hypothesis generators shared by the layout and collective property tests: meshes of 1-8
ranks on 1-3 axes, specs giving each axis a random role, shapes with uneven, tiny and 0 dims,
and per-rank tensors (consistent with a global value, or arbitrary)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fsdpx import Mesh, Spec
from fsdpx.sharding.layout import local_box, local_shape

NAMES = ("a", "b", "c")


@st.composite
def meshes(draw, max_axes: int = 3, max_ranks: int = 8, sizes: tuple[int, ...] = (2, 3, 1, 4)) -> Mesh:
    n = draw(st.sampled_from([2, 1, 3][:max_axes]))
    names = draw(st.permutations(NAMES))[:n]
    chosen, total = [], 1
    for _ in range(n):  # 2 first so that shrinking keeps real groups
        size = draw(st.sampled_from(sizes))
        chosen.append(size if total * size <= max_ranks else 1)
        total *= chosen[-1]
    return Mesh(**dict(zip(names, chosen)))


@st.composite
def specs(draw, mesh: Mesh, ndim: int, partial: bool = True) -> Spec:
    """Each mesh axis, in random order (which fixes major/minor inside a dim), is replicated,
    partial, or appended to a random dim."""
    entries: list[list[str]] = [[] for _ in range(ndim)]
    part = []
    for a in draw(st.permutations(mesh.axis_names)):
        role = draw(st.integers(-2 if partial else -1, ndim - 1))
        if role == -2:
            part.append(a)
        elif role >= 0:
            entries[role].append(a)
    return Spec(*[tuple(e) for e in entries], partial=tuple(part))


def shapes(ndim: int, max_size: int = 7):
    return st.tuples(*[st.integers(0, max_size) for _ in range(ndim)])


def consistent_locals(t: torch.Tensor, spec: Spec, mesh: Mesh, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-rank blocks whose global value under ``spec`` is ``t``: replicas equal, and over the
    partial axes a random split ``t = base + R_1 + ... `` (not just value-and-zeros)."""
    k = mesh.axis_size(spec.partial)
    extra = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(k - 1)]
    base = t - sum(extra, torch.zeros_like(t))
    pieces = [base] + extra
    out = []
    for r in range(mesh.size):
        src = pieces[mesh.index(r, spec.partial)]
        for d, (s, e) in enumerate(local_box(tuple(t.shape), spec, mesh, r)):
            src = src.narrow(d, s, e - s)
        out.append(src.clone())
    return out


def arbitrary_locals(shape, spec: Spec, mesh: Mesh, gen: torch.Generator) -> list[torch.Tensor]:
    """Independent random blocks of the right local shapes (replicas need not agree)."""
    return [torch.randn(local_shape(shape, spec, mesh, r), generator=gen, dtype=torch.float64) for r in range(mesh.size)]


def torch_chunk_padded(t: torch.Tensor, k: int, dim: int) -> list[torch.Tensor]:
    """The reference: torch.chunk, then empty pieces until there are k."""
    pieces = list(torch.chunk(t, k, dim))
    while len(pieces) < k:
        pieces.append(t.narrow(dim, t.shape[dim], 0))
    return pieces


__all__ = ["meshes", "specs", "shapes", "consistent_locals", "arbitrary_locals", "torch_chunk_padded"]
