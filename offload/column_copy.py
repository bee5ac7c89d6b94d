"""Copies of a set of columns of a row-major ``[out, in]`` tensor: gather, gather-and-add, scatter.

ZenFlow moves columns (input features) of 2-D weights between the device's selected set and the
host's window: every step it gathers the unselected columns of each gradient into the window sum,
and when a window closes it gathers the host state of those columns for the host update and
scatters the result back. A column of a row-major tensor is strided, and torch's
``index_select(1, ...)`` / ``index_copy(1, ...)`` walk it as a general index operation, slower
than a plain row loop on the GPT's weights. The loops here copy row by row: for
each row, read the source columns in increasing order and write the destination row in order
(the indices are sorted, so both streams are nearly sequential).

They are copies and one float addition per element, so every element's bits are those of the
torch operations they replace (``tests/test_column_copy.py``). CPU float32/float64 tensors take
the compiled loop; anything else (CUDA, bfloat16) takes the torch operation. A compiled loop's
rows are split over the calling thread's intra-op threads (``offload.row_team``): one thread
reaches about half the memory bandwidth of two. :class:`ColumnCopies` queues a step's copies (every
weight's) and runs them with one hand-off to the helper threads.
"""

from __future__ import annotations

import numba
import torch
from torch import Tensor

from offload.row_team import RowJob, run_rows


@numba.njit(nogil=True, cache=True)
def _take(row, cols, dst, add):  # noqa: ANN001, ANN202
    """``dst[j] = row[cols[j]]``, or ``dst[j] += row[cols[j]]`` with ``add``, for every ``j``."""
    if add:
        for j in range(cols.shape[0]):
            dst[j] = dst[j] + row[cols[j]]
    else:
        for j in range(cols.shape[0]):
            dst[j] = row[cols[j]]


# Every loop below processes rows r0 <= r < r1 and touches only row r of each tensor
# (offload.row_team.RowJob): rows are split over threads by offload.row_team.run_rows.


@numba.njit(nogil=True, cache=True)
def _gather(src, cols, out, add, r0, r1):  # noqa: ANN001, ANN202
    for r in range(r0, r1):
        _take(src[r], cols, out[r], add)


@numba.njit(nogil=True, cache=True)
def _split(src, sel, picked, uns, acc, add, r0, r1):  # noqa: ANN001, ANN202
    for r in range(r0, r1):
        row = src[r]
        _take(row, sel, picked[r], False)
        _take(row, uns, acc[r], add)  # the row is in cache now: the second set of columns costs no second read of src


@numba.njit(nogil=True, cache=True)
def _split_wide(src, sel, picked, acc, add, r0, r1):  # noqa: ANN001, ANN202
    for r in range(r0, r1):
        row, a = src[r], acc[r]
        _take(row, sel, picked[r], False)
        if add:  # the whole row: a streaming loop LLVM vectorises, where a gather of most columns is not
            for j in range(row.shape[0]):
                a[j] = a[j] + row[j]
        else:
            for j in range(row.shape[0]):
                a[j] = row[j]


@numba.njit(nogil=True, cache=True)
def _scatter(dst, cols, src, r0, r1):  # noqa: ANN001, ANN202
    for r in range(r0, r1):
        row, values = dst[r], src[r]
        for j in range(cols.shape[0]):
            row[cols[j]] = values[j]


@numba.njit(nogil=True, cache=True)
def _scatter_two(dst, cols_a, src_a, cols_b, src_b, r0, r1):  # noqa: ANN001, ANN202
    for r in range(r0, r1):
        row, a, b = dst[r], src_a[r], src_b[r]
        for j in range(cols_a.shape[0]):
            row[cols_a[j]] = a[j]
        for j in range(cols_b.shape[0]):  # the row is in cache now: the second set costs no second pass
            row[cols_b[j]] = b[j]


class ColumnCopies:
    """A queue of compiled column copies, run together by :meth:`run`: every copy's rows split over
    the calling thread's intra-op threads (``offload.row_team.run_rows``), one hand-off to the
    helper threads for the whole batch rather than one per copy.

    Pass it as ``queue=`` to the functions below: they check their arguments at once (an error
    writes nothing), do a copy the compiled loop does not take (CUDA, bfloat16) at once with the
    torch operation, and queue the others; a returned tensor is written when :meth:`run` returns.
    The queued copies must write distinct elements that none of them reads (ZenFlow's step: each
    weight's gradient split into its own window sum, each parameter's own columns written; two
    scatters into disjoint columns of one tensor are fine), so their order does not matter and
    the bits are those of running each at once
    (``tests/test_column_copy.py::test_a_queue_gives_the_bits_of_copies_run_at_once``)."""

    def __init__(self) -> None:
        self.jobs: list[RowJob] = []

    def run(self, threads: int | None = None) -> None:
        """Run and empty the queue (``threads``: as :func:`offload.row_team.run_rows`)."""
        jobs, self.jobs = self.jobs, []
        run_rows(jobs, threads)


def launch_rows(queue: ColumnCopies | None, kernel, args: tuple, rows: int, size: int) -> None:  # noqa: ANN001
    """Run ``kernel`` (a compiled loop over rows ``r0 <= r < r1``, its last two arguments) over
    ``rows`` rows now (split over the caller's threads), or queue it on ``queue``; ``size``: the
    elements it copies (``offload.row_team.RowJob``)."""
    job = RowJob(kernel, args, rows, size)
    if queue is None:
        run_rows([job])
    else:
        queue.jobs.append(job)


def compiled_loop_applies(*tensors: Tensor) -> bool:
    """True when the compiled loop applies: CPU, one float32/float64 dtype, row-major 2-D."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.float64) and all(
        t.device.type == "cpu" and t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1 for t in tensors
    )


def _check(name: str, t: Tensor, cols: Tensor) -> None:
    if t.dim() != 2 or cols.dim() != 1:
        raise ValueError(f"{name} needs a 2-D tensor and 1-D column indices, got {tuple(t.shape)} and {tuple(cols.shape)}")


def gather_columns(src: Tensor, cols: Tensor, out: Tensor | None = None, *,
                   queue: ColumnCopies | None = None) -> Tensor:
    """``src[:, cols]`` as a new ``[out, len(cols)]`` tensor on ``src``'s device, or written into
    ``out`` (a buffer the caller reuses; any dtype and device, converted as ``copy_`` does).

    Guarantee: equals ``src.index_select(1, cols)`` bit for bit (any ``cols``, sorted or not);
    with ``out``, ``out.copy_(src.index_select(1, cols))``. Edge cases: empty ``cols`` gives
    ``[out, 0]``; an index outside ``[0, in)`` raises ``IndexError`` (checked before any copy); an
    ``out`` not shaped ``[out, len(cols)]`` raises ``ValueError``. ``queue``: see
    :class:`ColumnCopies`."""
    _check("gather_columns", src, cols)
    if out is not None and out.shape != (src.shape[0], cols.numel()):
        raise ValueError(f"out must be {(src.shape[0], cols.numel())}, got {tuple(out.shape)}")
    if not compiled_loop_applies(src, *([] if out is None else [out])) or not cols.numel():
        picked = src.index_select(1, cols.to(src.device))
        return picked if out is None else out.copy_(picked)
    check_column_range(cols, src.shape[1])
    out = torch.empty((src.shape[0], cols.numel()), dtype=src.dtype) if out is None else out
    launch_rows(queue, _gather, (numpy_view(src), numpy_view(cols), numpy_view(out), False), src.shape[0], out.numel())
    return out


def add_gathered_columns_(acc: Tensor, src: Tensor, cols: Tensor, *, queue: ColumnCopies | None = None) -> Tensor:
    """``acc += src[:, cols]`` in place (one rounding per element, as torch's ``add_``); returns ``acc``.

    Guarantee: equals ``acc.add_(src.index_select(1, cols))`` bit for bit. Raises ``ValueError``
    if ``acc`` is not ``[out, len(cols)]``. ``queue``: see :class:`ColumnCopies`."""
    _check("add_gathered_columns_", src, cols)
    if acc.shape != (src.shape[0], cols.numel()):
        raise ValueError(f"acc must be {(src.shape[0], cols.numel())}, got {tuple(acc.shape)}")
    if not compiled_loop_applies(acc, src) or not cols.numel():
        return acc.add_(src.index_select(1, cols.to(src.device)).to(device=acc.device, dtype=acc.dtype))
    check_column_range(cols, src.shape[1])
    launch_rows(queue, _gather, (numpy_view(src), numpy_view(cols), numpy_view(acc), True), src.shape[0], acc.numel())
    return acc


def split_columns_(src: Tensor, sel: Tensor, acc: Tensor, uns: Tensor, *, add: bool,
                   queue: ColumnCopies | None = None) -> Tensor:
    """``src[:, sel]`` as a new tensor, and in the same pass over ``src``'s rows ``acc = src[:,
    uns]`` (``add=False``) or ``acc += src[:, uns]`` (``add=True``), in place. ZenFlow's step
    reads each gradient once this way: its selected columns for the device update, the others
    into the window sum. Returns the gathered ``[out, len(sel)]`` tensor (``src``'s dtype).

    Guarantee: the result equals ``gather_columns(src, sel)`` and ``acc`` equals
    ``gather_columns(src, uns, out=acc)`` (``add=False``) or ``add_gathered_columns_(acc, src,
    uns)`` (``add=True``) bit for bit (``tests/test_column_copy.py::
    test_split_equals_a_gather_and_a_gather_and_add``). Edge cases: either index set may be empty;
    an index outside ``[0, in)`` raises ``IndexError`` before anything is written; an ``acc`` not
    ``[out, len(uns)]`` raises ``ValueError``. Tensors the compiled loop does not take (CUDA,
    bfloat16, mixed dtypes) go through the two torch operations (and their errors). ``queue``:
    see :class:`ColumnCopies`."""
    _check("split_columns_", src, sel)
    _check("split_columns_", src, uns)
    if acc.shape != (src.shape[0], uns.numel()):
        raise ValueError(f"acc must be {(src.shape[0], uns.numel())}, got {tuple(acc.shape)}")
    if not compiled_loop_applies(src, acc) or not sel.numel() or not uns.numel():
        picked = gather_columns(src, sel)
        if add:
            add_gathered_columns_(acc, src, uns)
        else:
            gather_columns(src, uns, out=acc)
        return picked
    check_column_range(sel, src.shape[1])
    check_column_range(uns, src.shape[1])
    picked = torch.empty((src.shape[0], sel.numel()), dtype=src.dtype)
    launch_rows(queue, _split, (numpy_view(src), numpy_view(sel), numpy_view(picked), numpy_view(uns), numpy_view(acc), add), src.shape[0], src.numel())
    return picked


def split_wide_(src: Tensor, sel: Tensor, acc: Tensor, *, add: bool, queue: ColumnCopies | None = None) -> Tensor:
    """``src[:, sel]`` as a new tensor, and in the same pass over ``src``'s rows ``acc = src``
    (``add=False``) or ``acc += src`` (``add=True``) over every column, in place. A window sum
    kept at the gradient's full width this way costs a streaming pass (about half the time of
    :func:`split_columns_`'s gather of most columns); its columns ``uns`` hold what
    :func:`split_columns_` would have written, the others are not used. Returns the gathered
    ``[out, len(sel)]`` tensor.

    Guarantee: the result equals ``gather_columns(src, sel)`` and ``acc`` equals ``src`` or
    ``acc.add_(src)`` bit for bit, so ``acc[:, uns]`` equals :func:`split_columns_`'s ``acc`` for
    any ``uns`` (``tests/test_column_copy.py::test_a_wide_split_holds_the_split_in_its_columns``).
    Raises ``ValueError`` for an ``acc`` not shaped like ``src``, ``IndexError`` for an index
    outside ``[0, in)`` (before anything is written). Tensors the compiled loop does not take go
    through torch's ``index_select`` and ``copy_`` / ``add_``. ``queue``: see
    :class:`ColumnCopies`."""
    _check("split_wide_", src, sel)
    if acc.shape != src.shape:
        raise ValueError(f"acc must be {tuple(src.shape)}, got {tuple(acc.shape)}")
    if not compiled_loop_applies(src, acc) or not sel.numel():
        picked = gather_columns(src, sel)
        acc.add_(src.to(acc.dtype)) if add else acc.copy_(src)
        return picked
    check_column_range(sel, src.shape[1])
    picked = torch.empty((src.shape[0], sel.numel()), dtype=src.dtype)
    launch_rows(queue, _split_wide, (numpy_view(src), numpy_view(sel), numpy_view(picked), numpy_view(acc), add), src.shape[0], src.numel())
    return picked


def scatter_columns_(dst: Tensor, cols: Tensor, src: Tensor, *, queue: ColumnCopies | None = None) -> Tensor:
    """``dst[:, cols] = src`` in place; returns ``dst``.

    Guarantee: equals ``dst.index_copy_(1, cols, src)`` bit for bit for distinct ``cols``.
    Raises ``ValueError`` if ``src`` is not ``[out, len(cols)]``. ``queue``: see :class:`ColumnCopies`."""
    _check("scatter_columns_", dst, cols)
    if src.shape != (dst.shape[0], cols.numel()):
        raise ValueError(f"src must be {(dst.shape[0], cols.numel())}, got {tuple(src.shape)}")
    if not compiled_loop_applies(dst, src) or not cols.numel():
        return dst.index_copy_(1, cols.to(dst.device), src.to(dst.device))
    check_column_range(cols, dst.shape[1])
    launch_rows(queue, _scatter, (numpy_view(dst), numpy_view(cols), numpy_view(src)), dst.shape[0], src.numel())
    return dst


def scatter_two_columns_(dst: Tensor, cols_a: Tensor, src_a: Tensor, cols_b: Tensor, src_b: Tensor, *,
                         queue: ColumnCopies | None = None) -> Tensor:
    """``dst[:, cols_a] = src_a`` and ``dst[:, cols_b] = src_b`` in place, in one pass over
    ``dst``'s rows; returns ``dst``. ZenFlow writes a landed host window's columns and the
    selected columns' new values into a parameter this way at a window end.

    Guarantee: for disjoint ``cols_a`` and ``cols_b`` (each without repeats) equals
    ``scatter_columns_(scatter_columns_(dst, cols_a, src_a), cols_b, src_b)`` bit for bit, in
    either order (``tests/test_column_copy.py::test_scatter_two_equals_two_scatters``). Edge
    cases: either set may be empty; an index outside ``[0, in)`` raises ``IndexError`` (before
    anything is written in the compiled loop); a ``src`` not ``[out, len(cols)]`` raises ``ValueError``. Tensors the
    compiled loop does not take (CUDA, bfloat16, mixed dtypes) take the two scatters. ``queue``:
    see :class:`ColumnCopies`."""
    _check("scatter_two_columns_", dst, cols_a)
    _check("scatter_two_columns_", dst, cols_b)
    for cols, src in ((cols_a, src_a), (cols_b, src_b)):
        if src.shape != (dst.shape[0], cols.numel()):
            raise ValueError(f"src must be {(dst.shape[0], cols.numel())}, got {tuple(src.shape)}")
    if not compiled_loop_applies(dst, src_a, src_b) or not cols_a.numel() or not cols_b.numel():
        return scatter_columns_(scatter_columns_(dst, cols_a, src_a, queue=queue), cols_b, src_b, queue=queue)
    check_column_range(cols_a, dst.shape[1])
    check_column_range(cols_b, dst.shape[1])
    launch_rows(queue, _scatter_two, (numpy_view(dst), numpy_view(cols_a), numpy_view(src_a), numpy_view(cols_b), numpy_view(src_b)), dst.shape[0],
            src_a.numel() + src_b.numel())
    return dst


def numpy_view(t: Tensor):  # noqa: ANN202
    """A numpy view of ``t``'s memory (writes through); ``detach`` so that parameters work too."""
    return t.detach().numpy()


def check_column_range(cols: Tensor, n: int) -> None:
    """Raises ``ValueError`` unless ``cols`` is a CPU int64 tensor, ``IndexError`` unless every
    index is in ``[0, n)`` (``cols`` non-empty): what a compiled loop checks before it writes."""
    if cols.dtype != torch.int64 or cols.device.type != "cpu":
        raise ValueError(f"column indices must be a CPU int64 tensor, got {cols.dtype} on {cols.device}")
    lo, hi = int(cols.min()), int(cols.max())
    if lo < 0 or hi >= n:
        raise IndexError(f"column index out of range [0, {n}): min {lo}, max {hi}")

