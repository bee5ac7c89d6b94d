"""Entering and leaving a tensor-parallel region: activation collectives as autograd functions.

Inside a region (between a column-parallel and the next row-parallel layer) every rank of a
``tp`` group computes on its own slice of the features; outside, every rank holds the whole
activation and computes the same thing (Megatron's convention: a replicated activation has a
replicated gradient). Each boundary is a change of layout of one activation, executed with the
algebra's ``plan`` on the group's sub-mesh, forward and backward alike:

====================  ================================  ====================  =====================
boundary              forward (layout change)           consumer's gradient   backward
====================  ================================  ====================  =====================
``enter``             replicated -> replicated (none)   partial over ``tp``   all-reduce (``f``)
``leave``             partial -> replicated (AR)        replicated            none (``g``)
``enter`` (sequence)  sequence split -> replicated (AG)  partial over ``tp``   reduce-scatter
``leave`` (sequence)  partial -> sequence split (RS)     sequence split        all-gather
====================  ================================  ====================  =====================

With sequence parallelism (``seq_dim`` given) the activations between regions are split along
the sequence instead of replicated, and each all-reduce becomes a reduce-scatter or an
all-gather of the same bytes; there the backward is exactly ``adjoint`` of the forward.

The backward is ``plan(consumer's gradient layout, gradient layout of the source)``, where the
gradient of a partial value is replicated (each summand receives the whole gradient) and the
consumer of an entered activation is divergent compute, whose input gradient is partial. So the
bytes of both directions come from the same ``plan`` the cost model reads; ``enter``'s backward
is exactly ``leave``'s forward (the f/g pair).

Collectives run on ``comm.mesh.sub(axis)``: activations of different data-parallel groups have
different batch sizes, so each tensor-parallel group exchanges on its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fsdpx.sharding.collectives import Collective, cached_plan
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import chunk_bounds
from fsdpx.sharding.spec import Spec


def _run(comm: Comm, steps: tuple[Collective, ...], x: Tensor) -> Tensor:
    for c in steps:
        x = comm.run(c, x.contiguous())
    return x


class _Redistribute(torch.autograd.Function):
    """Forward runs ``forward_plan``, backward runs ``backward_plan`` on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm, forward_plan: tuple, backward_plan: tuple) -> Tensor:
        ctx.comm, ctx.backward_plan = comm, backward_plan
        out = _run(comm, forward_plan, x)
        # the privacy tape's proof of example rows (privacy/example_rows.py) may pass through a
        # boundary that keeps every row where it was: any that leaves the shape as it is (an
        # identity or an all-reduce of the same rows); a sequence split or gather does not
        ctx.preserves_rows = out.shape == x.shape
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        out = _run(ctx.comm, ctx.backward_plan, grad)
        return out, None, None, None


def redistribute(x: Tensor, comm: Comm, axis: str, src: Spec, dst: Spec, *, divergent: bool,
                 shape: tuple[int, ...] | None = None) -> Tensor:
    """``x`` (this rank's block, laid out as ``src`` on the ``axis`` group) laid out as ``dst``.

    Returns a tensor whose backward sends the gradient from ``dst``'s consumer layout (partial
    over ``axis`` if ``divergent``: the consumer computes on a slice of the features) to the
    gradient layout of ``src`` (its partial axes replicated).

    Guarantees: forward and backward are the exact layout changes (values are unchanged up to
    the rank-order sums of ``SimulatedMesh``/the backend); every rank of the group runs the same
    collectives in the same order (``tests/test_tensor_parallel.py::
    test_region_boundaries_are_exact_and_move_the_planned_bytes``).

    ``shape``: the activation's shape over the whole group (default ``x.shape``, right when
    ``src`` splits no dim).

    Edge cases: a group of one rank runs no communication but still counts its buffers (the
    algebra's convention); specs must have ``x.dim()`` dims and use no axis but ``axis``."""
    sub = comm.mesh.sub(axis)
    shape = tuple(x.shape) if shape is None else tuple(shape)
    grad_src = dst.with_partial((axis,)) if divergent else dst
    grad_dst = src.with_partial(())
    forward = cached_plan(src, dst, shape, sub, x.dtype)
    backward = cached_plan(grad_src, grad_dst, shape, sub, x.dtype)
    return _Redistribute.apply(x, comm, forward, backward)


def enter(x: Tensor, comm: Comm, axis: str, *, seq_dim: int | None = None, seq_len: int = 0) -> Tensor:
    """Megatron's ``f``: identity forward; the input gradient, partial over ``axis`` because
    each rank's layers saw a slice of the features, is all-reduced in the backward. With
    ``seq_dim`` (sequence parallelism) ``x`` is this rank's chunk of a sequence of ``seq_len``:
    all-gathered along it forward, the gradient reduce-scattered back."""
    r = Spec.replicated(x.dim())
    if seq_dim is None:
        return redistribute(x, comm, axis, r, r, divergent=True)
    shape = list(x.shape)
    shape[seq_dim] = seq_len
    return redistribute(x, comm, axis, r.with_dim(seq_dim, axis), r, divergent=True, shape=tuple(shape))


def leave(x: Tensor, comm: Comm, axis: str, *, seq_dim: int | None = None) -> Tensor:
    """Megatron's ``g``: the partial output summed over ``axis`` (all-reduce) forward;
    identity backward (every rank already holds the whole gradient). With ``seq_dim``: summed
    and split along the sequence (reduce-scatter) forward, all-gathered backward."""
    r = Spec.replicated(x.dim())
    dst = r if seq_dim is None else r.with_dim(seq_dim, axis)
    return redistribute(x, comm, axis, r.with_partial((axis,)), dst, divergent=False)


def sequence_chunk(x: Tensor, comm: Comm, axis: str, seq_dim: int) -> Tensor:
    """This rank's chunk of ``x`` (the whole sequence) along ``seq_dim``: a local slice, no
    communication (``torch.chunk`` semantics, as ``leave`` splits activations)."""
    k, i = comm.mesh.axis_size(axis), comm.mesh.index(comm.rank, axis)
    a, b = chunk_bounds(x.shape[seq_dim], k, i)
    return x.narrow(seq_dim, a, b - a)
