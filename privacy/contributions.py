"""Per-example gradient contributions in the forms book-keeping needs.

One call of a layer contributes, for every example ``i``, a gradient ``g_i`` to each of its
parameters. Two forms cover every supported layer:

* :class:`Factored` — ``g_i = sum_t left[i, t] (outer) right[i, t]``, an ``[m, n]`` matrix
  (Linear: output grad x input; Embedding: one-hot id x output grad; Conv: output grad x
  unfolded patch). ``left`` is dense ``[B, T, m]`` or, for one-hot rows, integer ids ``[B, T]``.
  It may cover a block of rows ``[r0, r1)`` of the parameter viewed as ``[rows, n]`` (grouped
  convolutions).
* :class:`Dense` — ``g_i`` instantiated, ``[B, *param.shape]`` (biases, norm weights, and the
  per-module vmap fallback).

From a list of contributions to one parameter this module computes the per-example squared
norm of their SUM (cross terms included, so tied weights are exact) and the clipped sum
``sum_i c_i g_i``. Two cost rules decide how much is formed:

* for the norm alone, the Gram form or instantiation (:func:`gram_cost` /
  :func:`instantiate_cost`), whichever costs fewer multiply-adds;
* before that, :func:`instantiate_for_reuse` may instantiate a parameter's per-example gradients
  once and use them for BOTH its norm and its clipped sum: that skips the Gram products and the
  ``L^T diag(c) R`` matmul, at the price of holding ``B x param`` floats until the clipping
  factors are known (:func:`reuse_saving` states the trade; a byte budget bounds the memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class Factored:
    left: Tensor  # [B, T, m] floating, or [B, T] int64 one-hot ids
    right: Tensor  # [B, T, n]
    m: int  # size of the left factor (vocabulary size for ids)
    rows: tuple[int, int]  # the row block [r0, r1) of the parameter viewed as [rows, n]

    @property
    def one_hot(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def steps(self) -> int:
        return self.right.shape[1]


@dataclass(frozen=True)
class Dense:
    grads: Tensor  # [B, *param_shape]


Contribution = Union[Factored, Dense]


def gram_cost(parts: list[Factored]) -> int:
    """Multiply-adds per example of the Gram form: ``T_u T_v (m' + n)`` over unordered pairs,
    with ``m' = 1`` when either left factor is one-hot (a compare or a gather replaces the dot
    product)."""
    cost = 0
    for i, u in enumerate(parts):
        for v in parts[i:]:
            left = 1 if (u.one_hot or v.one_hot) else u.m
            cost += u.steps * v.steps * (left + u.right.shape[2])
    return cost


def instantiate_cost(parts: list[Factored]) -> int:
    """Multiply-adds per example of forming ``g_i``: ``T m n`` per part (``T n`` for one-hot
    ids, which are scattered) plus about four passes over the ``m n`` result (zero, add,
    square, sum), since on CPU those passes are bound by memory, not arithmetic."""
    n = parts[0].right.shape[2]
    rows = max(p.rows[1] for p in parts)
    return sum(p.steps * n * (1 if p.one_hot else p.m) for p in parts) + 4 * rows * n


def _left_gram(u: Factored, v: Factored) -> Tensor:
    """``[B, T_u, T_v]`` inner products of left factors (one-hot ids compare or gather)."""
    if u.one_hot and v.one_hot:
        return (u.left[:, :, None] == v.left[:, None, :]).to(u.right.dtype)
    if u.one_hot:
        return _left_gram(v, u).transpose(1, 2)
    if v.one_hot:  # <l_t, e_{x_s}> = l_t[x_s]
        return torch.gather(u.left, 2, v.left[:, None, :].expand(-1, u.steps, -1))
    return torch.bmm(u.left, v.left.transpose(1, 2))


def _pair_inner(u: Factored, v: Factored) -> Tensor:
    """``<g_u,i, g_v,i>`` for every example via Gram matrices, ``[B]``."""
    if u.rows != v.rows:
        return u.right.new_zeros(u.right.shape[0])  # disjoint row blocks never overlap here
    right = torch.bmm(u.right, v.right.transpose(1, 2))  # (B, T_u, T_v)
    return (_left_gram(u, v) * right).sum((1, 2))  # faster on CPU than a (1 x K) @ (K x 1) bmm


def instantiate(part: Factored, num_rows: int) -> Tensor:
    """The per-example gradient ``[B, num_rows, n]`` of one factored part."""
    B, T, n = part.right.shape
    r0, r1 = part.rows
    if not part.one_hot and (r0, r1) == (0, num_rows):
        return torch.bmm(part.left.transpose(1, 2), part.right)
    out = part.right.new_zeros(B, num_rows, n)
    if part.one_hot:
        ids = part.left + r0 + torch.arange(B, device=out.device)[:, None] * num_rows
        out.view(B * num_rows, n).index_add_(0, ids.reshape(-1), part.right.reshape(B * T, n))
    else:
        out[:, r0:r1] = torch.bmm(part.left.transpose(1, 2), part.right)
    return out


REUSE_MEMORY_MACS = 16
"""Multiply-add equivalents charged per element of instantiated per-example gradients that are
kept for reuse: written once and read twice (norm, clipped sum), from the last-level cache."""

REUSE_MAX_BYTES = 32 * 2**20
"""Largest per-example gradient block (all examples, one parameter) kept for reuse: about the
last-level cache of the 2-core machines this project runs on (35.8 MiB L3). Beyond it the
writes and re-reads stream through DRAM and cost more than the Gram products they save (the GPT
LM head, 16 x 8192 x 256 floats, is slower reused than in Gram form on these machines)."""


def reuse_saving(parts: list[Contribution], param_shape: torch.Size) -> int | None:
    """Multiply-adds per example saved by instantiating ``sum_u g_u,i`` once and reusing it for
    the norm and the clipped sum, or ``None`` when reuse does not apply (no factored part with
    a dense left factor: one-hot and dense-only parameters are already cheap).

    Without reuse: the norm (the cheaper of :func:`gram_cost` and :func:`instantiate_cost`) plus
    the clipped-sum matmul, ``T m n`` per part. With reuse: ``T m n`` per part (one-hot parts
    ``T n``) plus ``REUSE_MEMORY_MACS`` per element of the ``[rows, n]`` result. The saving may be
    negative (reuse then costs more)."""
    factored = [p for p in parts if isinstance(p, Factored)]
    if not any(not p.one_hot for p in factored):
        return None
    if any(isinstance(p, Dense) for p in parts) or rows_overlap(factored):
        norm = instantiate_cost(factored)
    else:
        norm = min(gram_cost(factored), instantiate_cost(factored))
    # The instantiating matmul of reuse costs what the clipped-sum matmul costs without it, so
    # the two cancel: reuse saves the norm and pays for the memory traffic.
    return norm - REUSE_MEMORY_MACS * math.prod(param_shape)


def factor_bytes(parts: dict[str, list[Contribution]]) -> int:
    """Bytes held by the factors of every factored contribution (distinct tensors counted once):
    the tape's activations and output gradients that the norms and clipped sums read."""
    return _distinct_bytes(t for plist in parts.values() for p in plist if isinstance(p, Factored)
                           for t in (p.left, p.right))


def kept_bytes(parts: dict[str, list[Contribution]]) -> int:
    """Bytes every contribution in ``parts`` holds: factors and dense per-example gradients,
    each distinct tensor once (a view counts its base). What a pipeline stage keeps of one
    microbatch from its backward to its clipped sums (``fsdpx.jobs.memory.contribution_bytes``).
    Edge case: an empty dict holds 0 (``tests/test_contribution_bytes.py``)."""
    return _distinct_bytes(t for plist in parts.values() for p in plist
                           for t in ((p.left, p.right) if isinstance(p, Factored) else (p.grads,)))


def _distinct_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        base = t._base if t._base is not None else t
        seen[id(base)] = base.numel() * base.element_size()
    return sum(seen.values())


def instantiate_for_reuse(
    parts: dict[str, list[Contribution]], shapes: dict[str, torch.Size], *, budget_bytes: int | None = None
) -> dict[str, list[Contribution]]:
    """Replaces, IN ``parts``, some parameters' contributions by ONE :class:`Dense` holding their
    summed per-example gradients, so the norm and the clipped sum both read it; returns ``parts``.
    In place on purpose: a replaced entry's factors are freed before the next block is formed.

    Chosen: parameters with a positive :func:`reuse_saving` whose block is at most
    ``REUSE_MAX_BYTES``, by saving per byte, while the blocks kept fit ``budget_bytes`` (default
    :func:`factor_bytes` of ``parts``: reuse never holds more than the tape's own factors).

    Guarantees: the norms and clipped sums computed from the result equal those from the
    original ``parts`` to float rounding (``property_tests/test_ghost_properties.py::
    test_reused_instantiation_gives_the_same_norms_and_clipped_sums``).
    Edge cases: ``budget_bytes=0`` changes nothing; an empty dict gives an empty dict."""
    budget = factor_bytes(parts) if budget_bytes is None else budget_bytes
    ranked = []
    for name, plist in parts.items():
        saving = reuse_saving(plist, shapes[name])
        if saving is None or saving <= 0:
            continue
        factored = [p for p in plist if isinstance(p, Factored)]
        block = factored[0].right.shape[0] * math.prod(shapes[name]) * factored[0].right.element_size()
        if block <= REUSE_MAX_BYTES:
            ranked.append((saving / block, name, block))
    for _, name, block in sorted(ranked, reverse=True):
        if block > budget:
            continue
        budget -= block
        parts[name] = [Dense(instantiate_sum(parts[name], shapes[name]))]
    return parts


def instantiate_sum(parts: list[Contribution], param_shape: torch.Size) -> Tensor:
    """``[B, *param_shape]``: the per-example gradient summed over all contributions."""
    factored = [p for p in parts if isinstance(p, Factored)]
    dense = [p.grads for p in parts if isinstance(p, Dense)]
    g = dense[0] if not factored else None  # Dense only (a norm weight, a bias): no matmul
    for p in factored:
        one = instantiate(p, param_shape[0]).view(-1, *param_shape)
        g = one if g is None else g + one
    for d in (dense[1:] if not factored else dense):
        g = g + d
    return g


def _one_hot_sq_norms(parts: list[Factored]) -> Tensor:
    """Squared norms for parts that are all one-hot on the same rows, in ``O(B T n)``: rows
    hit by several steps are summed first, so nothing ``[B, m, n]`` is formed."""
    B = parts[0].right.shape[0]
    n = parts[0].right.shape[2]
    ids = torch.cat([p.left for p in parts], 1) if len(parts) > 1 else parts[0].left  # [B, T]
    vals = torch.cat([p.right for p in parts], 1) if len(parts) > 1 else parts[0].right  # [B, T, n]
    keys = (ids + torch.arange(B, device=ids.device)[:, None] * parts[0].m).reshape(-1)
    # the distinct (example, row) keys without torch.unique, whose output size the host must
    # read from the device: sort, number the runs of equal keys (a run per distinct key), and
    # sum each run into a buffer of the static size len(keys); unused slots stay zero
    order = torch.argsort(keys)
    sorted_keys = keys[order]
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    run = torch.cumsum(starts, 0) - 1  # the run (distinct key) of each sorted position
    slot = torch.empty_like(run).scatter_(0, order, run)  # the run of each original position
    rows = vals.new_zeros(keys.numel(), n).index_add_(0, slot, vals.reshape(-1, n))
    example = torch.zeros_like(keys).scatter_(0, run, torch.div(sorted_keys, parts[0].m, rounding_mode="floor"))
    return vals.new_zeros(B).index_add_(0, example, rows.pow(2).sum(1))


def sq_norms(parts: list[Contribution], param_shape: torch.Size, *, force_instantiate: bool = False) -> Tensor:
    """Per-example ``||sum_u g_u,i||^2`` for all contributions to one parameter, ``[B]``.

    Guarantees: equals the squared norm of the summed per-example gradients (cross terms
    between contributions included), whichever form is used (``property_tests/
    test_ghost_properties.py::test_ghost_norms_equal_vmap_norms``)."""
    dense = [p.grads for p in parts if isinstance(p, Dense)]
    factored = [p for p in parts if isinstance(p, Factored)]
    if not factored:
        total = torch.stack(dense).sum(0) if len(dense) > 1 else dense[0]
        return _row_sq_norms(total)
    num_rows = param_shape[0]
    if dense or force_instantiate or rows_overlap(factored) or _prefer_instantiate(factored):
        g = sum(instantiate(p, num_rows) for p in factored).view(-1, *param_shape)
        g = g + sum(dense) if dense else g
        return _row_sq_norms(g)
    if all(p.one_hot for p in factored) and len({p.rows for p in factored}) == 1:
        return _one_hot_sq_norms(factored)
    # <sum_u g_u, sum_v g_v> = sum_u <g_u, g_u> + 2 sum_{u<v} <g_u, g_v>
    total = sum(_pair_inner(u, u) for u in factored)
    for i, u in enumerate(factored):
        for v in factored[i + 1:]:
            total = total + 2 * _pair_inner(u, v)
    return total


def _row_sq_norms(g: Tensor) -> Tensor:
    """``[B]`` squared L2 norms of the rows of ``g`` flattened after dim 0, in one pass."""
    return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()


def rows_overlap(parts: list[Factored]) -> bool:
    """True when two parts cover different but overlapping row blocks (Gram pairs assume
    equal or disjoint blocks): those parts' norms and sums must go through the instantiated
    gradient (here and in ``privacy.streaming``). False for no parts or a single block.
    Proven with the norms and sums it routes: ``property_tests/test_ghost_properties.py``."""
    blocks = {p.rows for p in parts}
    return any(a != b and a[0] < b[1] and b[0] < a[1] for a in blocks for b in blocks)


def _prefer_instantiate(parts: list[Factored]) -> bool:
    if all(p.one_hot for p in parts):
        return False  # the O(T n) one-hot path beats both forms
    return instantiate_cost(parts) < gram_cost(parts)


def weighted_sum(parts: list[Contribution], weights: Tensor, param_shape: torch.Size, *,
                 out: Tensor | None = None) -> Tensor:
    """``sum_i weights[i] * sum_u g_u,i`` shaped like the parameter: ``L^T diag(w) R`` for
    factored parts (one matmul, no per-example gradient), an einsum for dense ones. With
    ``out`` (a contiguous tensor of ``param_shape``: a running sum over microbatches) the
    result is added into it in place (``addmm_`` / ``addmv_``: no temporary, no extra pass)
    and ``out`` is returned.

    Guarantees: with ``weights == 1`` this is the ordinary batch gradient
    (``test_clipped_grad_with_infinite_clip_norm_is_the_batch_gradient``); with ``out`` it
    equals ``out + weighted_sum(parts, weights, param_shape)`` to float rounding
    (``test_weighted_sum_into_a_running_sum``)."""
    num_rows = param_shape[0] if len(param_shape) else 1
    if out is not None:
        total = out
        for p in parts:
            if isinstance(p, Dense):  # += grads^T w, the einsum as one matrix-vector product
                total.view(-1).addmv_(p.grads.reshape(p.grads.shape[0], -1).transpose(0, 1), weights)
        parts = [p for p in parts if not isinstance(p, Dense)]
    elif len(parts) == 1 and isinstance(parts[0], Dense):
        return torch.tensordot(weights, parts[0].grads, dims=1).reshape(param_shape)
    else:
        total = _first_product(parts, weights, param_shape, num_rows)
        if total is not None:
            parts = parts[1:]
        else:
            total = weights.new_zeros(param_shape)
    flat = total.view(num_rows, -1)
    for p in parts:
        if isinstance(p, Dense):
            total += torch.tensordot(weights, p.grads, dims=1)
            continue
        B, T, n = p.right.shape
        w = weights[:, None, None]
        r0, r1 = p.rows
        if p.one_hot:
            flat.index_add_(0, p.left.reshape(-1) + r0, (p.right * w).reshape(B * T, n))
            continue
        left, right = p.left.reshape(B * T, p.m), p.right.reshape(B * T, n)
        if p.m < n:  # scale the smaller factor
            left = (p.left * w).reshape(B * T, p.m)
        else:
            right = (p.right * w).reshape(B * T, n)
        flat[r0:r1].addmm_(left.transpose(0, 1), right)  # accumulate in place: no temporary
    return total


def _first_product(parts: list[Contribution], weights: Tensor, param_shape: torch.Size,
                   num_rows: int) -> Tensor | None:
    """``L^T diag(w) R`` of the first part as a fresh tensor when it covers every row (a dense
    factored part: any Linear), so the sum starts from it instead of from a zero-filled buffer
    (one memory pass less per parameter); None otherwise."""
    p = parts[0] if parts else None
    if not isinstance(p, Factored) or p.one_hot or p.rows != (0, num_rows):
        return None
    B, T, n = p.right.shape
    w = weights[:, None, None]
    left, right = p.left.reshape(B * T, p.m), p.right.reshape(B * T, n)
    if p.m < n:
        left = (p.left * w).reshape(B * T, p.m)
    else:
        right = (p.right * w).reshape(B * T, n)
    return torch.mm(left.transpose(0, 1), right).view(param_shape)


def mask_examples(parts: list[Contribution], keep: Tensor) -> list[Contribution]:
    """Contributions with the rows of dropped examples set to zero (NaN-safe: ``where``, not a
    product), so they add nothing to any sum."""
    out: list[Contribution] = []
    for p in parts:
        if isinstance(p, Dense):
            k = keep.view(-1, *([1] * (p.grads.dim() - 1)))
            out.append(Dense(torch.where(k, p.grads, torch.zeros_like(p.grads))))
        else:
            k = keep[:, None, None]
            left = p.left if p.one_hot else torch.where(k, p.left, torch.zeros_like(p.left))
            out.append(Factored(left, torch.where(k, p.right, torch.zeros_like(p.right)), p.m, p.rows))
    return out
