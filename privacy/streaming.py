"""Per-example streaming: the clipped sums of the last parameters, one example at a time.

Ghost clipping needs each example's norm over ALL parameters before it may weight any of that
example's gradients. For most parameters that forces the Gram form for the norm plus a second
matmul for the clipped sum ``L^T diag(c) R``, or holding all ``B`` per-example gradients
(:func:`privacy.contributions.instantiate_for_reuse`). But once every other parameter's norm is
known, the remaining ones can go example by example: form ``g_i`` (one matmul, the work the
clipped-sum matmul would do anyway), complete the example's norm, and add ``c_i g_i`` to the
sum while ``g_i`` is still in cache. The Gram products are skipped and only ONE example's
gradients are held. On the GPT this is the LM head: its Gram form costs about half its gradient.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from privacy.contributions import REUSE_MAX_BYTES, Contribution, Factored, reuse_saving, rows_overlap

STREAM_MAX_BYTES = REUSE_MAX_BYTES
"""Most bytes of ONE example's gradients of all streamed parameters together: they are formed,
read for the norm and read again for the sum, so they should stay in the last-level cache."""


def choose_streamed(parts: dict[str, list[Contribution]], shapes: dict[str, torch.Size]) -> list[str]:
    """Names of the parameters whose clipped sums are streamed, in a deterministic order.

    Eligible: every contribution factored, at least one with a dense left factor, rows not
    partly overlapping, and a positive :func:`~privacy.contributions.reuse_saving` (the Gram
    products skipped minus the cost of writing and re-reading ``g_i``; the instantiating matmul
    replaces the clipped-sum matmul). Ranked by saving per byte and taken while one example's
    gradients of all chosen parameters fit :data:`STREAM_MAX_BYTES`.

    Edge cases: no eligible parameter gives ``[]``; parameters already instantiated for reuse
    (one ``Dense``) are never eligible."""
    ranked = []
    for name, plist in parts.items():
        if not plist or not all(isinstance(p, Factored) for p in plist):
            continue
        saving = reuse_saving(plist, shapes[name])
        if saving is None or saving <= 0 or rows_overlap(plist):
            continue
        nbytes = math.prod(shapes[name]) * plist[0].right.element_size()
        ranked.append((-saving / nbytes, name, nbytes))
    chosen, room = [], STREAM_MAX_BYTES
    for _, name, nbytes in sorted(ranked):
        if nbytes <= room:
            chosen.append(name)
            room -= nbytes
    return chosen


def stream_clipped_sums(
    parts: dict[str, list[Contribution]],
    shapes: dict[str, torch.Size],
    sq_rest: Tensor,
    factor: Callable[[Tensor], Tensor],
    keep: Tensor | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Returns ``(sums, sq)``: ``sq[i] = sq_rest[i] + sum_name ||g_i[name]||^2`` is example
    ``i``'s squared norm over all parameters, and ``sums[name] = sum_i c_i g_i[name]`` over the
    examples with a finite ``sq[i]``, where ``c_i = factor(sqrt(sq[i]))`` (``factor`` maps a
    ``[1]`` norm to its ``[1]`` clipping factor).

    Guarantees: equals the norms and clipped sums of the factored forms to float rounding
    (``property_tests/test_ghost_properties.py::test_streamed_clipped_sums_equal_the_factored_forms``).
    An example with a non-finite norm adds nothing (not even NaN) to any sum; the caller
    decides whether to raise (it sees the non-finite ``sq[i]``). An example with ``keep[i]``
    False (padding) adds nothing either; its ``sq[i]`` is still computed.

    Edge cases: empty ``parts`` returns ``({}, sq_rest)``; ``B == 0`` gives zero sums."""
    sq = sq_rest.clone()
    sums = {name: sq_rest.new_zeros(shapes[name]) for name in parts}
    scratch = {name: sq_rest.new_empty(shapes[name]) for name in parts}
    for i in range(sq_rest.shape[0]):
        total = sq_rest[i]
        for name, plist in parts.items():
            _example_grad(plist, i, scratch[name])
            total = total + torch.linalg.vector_norm(scratch[name]).square()
        sq[i] = total
        if not math.isfinite(float(total)) or (keep is not None and not bool(keep[i])):
            continue
        c = float(factor(total.sqrt().view(1))[0])
        for name in parts:
            sums[name].add_(scratch[name], alpha=c)
    return sums, sq


def _example_grad(plist: list[Contribution], i: int, out: Tensor) -> None:
    """Writes example ``i``'s gradient of one parameter (the sum of its contributions) into ``out``,
    every part accumulated into ``out`` in place: a part covering every row with a dense left
    factor is written first by a matmul into ``out`` (no zero fill), the others are added by
    ``addmm_`` (dense) or ``index_add_`` (one-hot ids: a tied embedding's rows) on their row
    block; nothing parameter-sized is allocated per example (a tied LM head streamed: ``tests/
    test_clipping.py::test_streaming_the_lm_head_gives_the_clipped_grad_of_the_factored_forms``)."""
    rows = out.shape[0]
    flat = out.view(rows, -1)
    full = next((p for p in plist if not p.one_hot and p.rows == (0, rows)), None)
    if full is not None:
        torch.mm(full.left[i].transpose(0, 1), full.right[i], out=flat)
    else:
        flat.zero_()
    for p in plist:
        if p is full:
            continue
        r0, r1 = p.rows
        if p.one_hot:
            flat.index_add_(0, p.left[i] + r0, p.right[i])
        else:
            flat[r0:r1].addmm_(p.left[i].transpose(0, 1), p.right[i])

