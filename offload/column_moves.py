"""Column moves inside a tensor's own memory: compaction, and a selection's handover.

ZenFlow's reselection changes which columns of a weight live where. Two moves do it without a
new tensor or a second pass over the full-width host tensors:

* :func:`compact_columns_` keeps a sorted subset of a ``[rows, n]`` tensor's columns, laid out
  as a ``[rows, k]`` tensor at the start of the same memory (the window that carries on from
  the landed one, minus the columns entering the selection: its master, slots and window sum).
* :func:`handover_columns_` moves a selection of the same size in one pass over the rows: the
  leaving columns' values from the ``[rows, s]`` selected tensor into the full-width tensor, the
  entering ones from the full-width tensor into it, the kept ones to their new places.

Both are copies, so every element's bits are those of the ``index_select`` / ``index_copy_``
they replace (``tests/test_column_moves.py``). CPU float32/float64 tensors take a compiled loop;
anything else takes the torch operations.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from offload.column_copy import ColumnCopies, check_column_range, compiled_loop_applies, launch_rows, numpy_view


@numba.njit(nogil=True, cache=True)
def _compact(flat, rows, n, pos):  # noqa: ANN001, ANN202
    # In increasing order of the destination: element (r, j) moves from r*n + pos[j] to
    # r*k + j, never past a source not yet read (pos[j] >= j and n >= k), so one thread, in order.
    k = pos.shape[0]
    for r in range(rows):
        for j in range(k):
            flat[r * k + j] = flat[r * n + pos[j]]


def compact_columns_(t: Tensor, positions: Tensor) -> Tensor:
    """``t[:, positions]`` as a ``[rows, len(positions)]`` tensor laid out at the start of
    ``t``'s own memory (``t`` must be contiguous); ``t``'s contents are then undefined.

    Guarantee: the result equals ``t.index_select(1, positions)`` as it was, bit for bit, and
    shares ``t``'s storage (``tests/test_column_moves.py::test_compaction_keeps_the_columns_in_place``).
    Runs on the calling thread alone (the move is in place, in order). Edge cases: ``positions``
    must be strictly increasing CPU int64 indices in ``[0, n)`` (``ValueError`` /
    ``IndexError`` before anything moves); empty ``positions`` give ``[rows, 0]``; a
    non-contiguous ``t`` raises ``ValueError``. Tensors the compiled loop does not take (CUDA,
    bfloat16) are gathered with torch and copied into place."""
    if t.dim() != 2 or positions.dim() != 1:
        raise ValueError(f"compact_columns_ needs a 2-D tensor and 1-D positions, got {tuple(t.shape)}"
                         f" and {tuple(positions.shape)}")
    if not t.is_contiguous():
        raise ValueError("compact_columns_ needs a contiguous tensor: it moves columns within its memory")
    rows, n, k = t.shape[0], t.shape[1], positions.numel()
    if k:
        check_column_range(positions, n)
        if k > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("compact_columns_ needs strictly increasing positions")
    view = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (rows, k))
    if k == n:
        return view
    if not compiled_loop_applies(t) or not k:
        return view.copy_(t.index_select(1, positions.to(t.device))) if k else view
    _compact(numpy_view(t).reshape(-1), rows, n, numpy_view(positions))
    return view


@numba.njit(nogil=True, cache=True)
def _handover(full, sel, leave_pos, leave_cols, src, enter_cols, entering, given, r0, r1):  # noqa: ANN001, ANN202
    s = sel.shape[1]
    old = np.empty(s, sel.dtype)
    for r in range(r0, r1):
        row, srow = full[r], sel[r]
        for q in range(s):
            old[q] = srow[q]
        for i in range(leave_pos.shape[0]):
            row[leave_cols[i]] = old[leave_pos[i]]
        e = 0
        for q in range(s):
            if src[q] >= 0:
                srow[q] = old[src[q]]
            else:
                srow[q] = entering[r, e] if given else row[enter_cols[e]]
                e += 1


def handover_columns_(full: Tensor, sel: Tensor, old: Tensor, new: Tensor, entering: Tensor | None = None, *,
                      queue: ColumnCopies | None = None) -> None:
    """Move the selection of ``sel``'s columns from ``old`` to ``new`` (sorted, distinct column
    indices of ``full``, the same number as ``sel``'s columns), in place: ``full[:, c] =
    sel[:, i]`` for each leaving column ``c = old[i]`` (not in ``new``), then ``sel[:, q]`` = the
    old ``sel`` column of ``new[q]`` where it was selected, else ``full[:, new[q]]``, or with
    ``entering`` (``[rows, number entering]``, the entering columns in order) its column.

    Guarantee: ``full`` and ``sel`` end bit for bit as ``offload.zenflow``'s gather and scatter
    handover leaves them (``tests/test_column_moves.py::test_a_handover_equals_its_gathers_and_scatters``),
    with one pass over each row of both. Raises ``ValueError`` for mismatched shapes. Tensors the
    compiled loop does not take go through ``index_select`` / ``index_copy_`` at once.
    ``queue``: see ``offload.column_copy.ColumnCopies`` (the queued moves must touch distinct
    tensors)."""
    if sel.dim() != 2 or full.dim() != 2 or sel.shape[0] != full.shape[0] or sel.shape[1] != old.numel() \
            or old.numel() != new.numel():
        raise ValueError(f"handover_columns_: full {tuple(full.shape)}, sel {tuple(sel.shape)}, "
                         f"{old.numel()} old and {new.numel()} new columns")
    if not old.numel():
        return
    leaving = ~torch.isin(old, new)
    src = torch.searchsorted(old, new).clamp_(max=old.numel() - 1)  # where new[q] would be in old
    kept = old[src] == new
    src = torch.where(kept, src, torch.full_like(src, -1))
    enter_cols = new[~kept]
    leave_pos = leaving.nonzero().squeeze(1)
    if entering is not None and tuple(entering.shape) != (full.shape[0], enter_cols.numel()):
        raise ValueError(f"handover_columns_: entering must be {(full.shape[0], enter_cols.numel())},"
                         f" got {tuple(entering.shape)}")
    if not compiled_loop_applies(full, sel, *([] if entering is None else [entering])):
        dev = sel.device
        before = sel.clone()
        full.index_copy_(1, old[leaving].to(full.device), before[:, leave_pos.to(dev)].to(full.device))
        sel.index_copy_(1, kept.nonzero().squeeze(1).to(dev), before.index_select(1, src[kept].to(dev)))
        values = full.index_select(1, enter_cols.to(full.device)) if entering is None else entering
        sel.index_copy_(1, (~kept).nonzero().squeeze(1).to(dev), values.to(dev))
        return
    check_column_range(old, full.shape[1])
    check_column_range(new, full.shape[1])
    given = entering is not None
    values = numpy_view(entering) if given else numpy_view(sel[:, :0])  # an unused array of the right type when not given
    launch_rows(queue, _handover, (numpy_view(full), numpy_view(sel), numpy_view(leave_pos), numpy_view(old[leaving]), numpy_view(src), numpy_view(enter_cols),
                               values, given), full.shape[0], sel.numel() * 2)
