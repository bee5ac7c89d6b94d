"""Compiled row loops run over their tensors' rows by the calling thread and helper threads.

ZenFlow's column copies on a CPU "device" (``offload.column_copy``) are loops over a weight's rows
that read and write only that row, compiled without the GIL (``numba.njit(nogil=True)``). One
thread reaches about half the memory bandwidth of two on this project's machines, while the
model's own operations (torch's intra-op threads) use every core. :func:`run_rows` gives the
loops the same threads: each job's rows are cut into contiguous ranges, taken in turn by the
calling thread and as many helper threads as its intra-op thread count asks for (one
process-wide pool, made on first use and dropped in a forked child).

A row is processed by exactly one thread, once, with the same operations as a single loop, so
the result does not depend on the thread count (``tests/test_row_team.py``).
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


@dataclass(frozen=True)
class RowJob:
    """``kernel(*args, r0, r1)`` processes rows ``r0 <= r < r1`` of tensors with ``rows`` rows.
    ``kernel`` must release the GIL and touch, for row ``r``, only row ``r`` of its outputs (or
    whatever else the range indexes, the columns of ``offload.columns.column_scores``: the parts
    of its outputs that range owns)."""

    kernel: Callable[..., None]
    args: tuple[Any, ...]
    rows: int
    size: int | None = None  # elements it reads or writes, if known: a small batch is not split


def run_rows(jobs: Sequence[RowJob], threads: int | None = None) -> None:
    """Run every job over all its rows; returns ``None`` once every row has run.

    ``threads`` (default: ``torch.get_num_threads()`` on the calling thread, so a worker thread
    that set its OpenMP count to 1 runs everything itself): each job's rows are cut into
    ``_PIECES`` contiguous ranges per thread, and the caller and ``threads - 1`` helper threads
    take the ranges in order as each finishes its last, so a thread the OS holds back (ZenFlow's
    background thread shares the cores) takes fewer. Guarantee: each row of each job is processed
    exactly once, so for kernels as :class:`RowJob` requires the outputs equal one sequential
    ``kernel(*args, 0, rows)`` per job, bit for bit, for any ``threads``
    (``tests/test_row_team.py::test_any_thread_count_gives_the_sequential_bits``). A batch whose
    jobs all give their ``size`` and touch fewer than ``_MIN_SPLIT`` elements in all runs on the
    caller alone. Edge cases: no jobs, or jobs with fewer rows than ranges (their empty ranges
    are skipped); a kernel's
    exception is re-raised here once every thread has stopped (the other threads finish the
    remaining ranges)."""
    n = max(1, torch.get_num_threads() if threads is None else threads)
    if all(j.size is not None for j in jobs) and sum(j.size for j in jobs) < _MIN_SPLIT:
        n = 1  # handing it to the helpers would cost more than it saves
    if n == 1:
        for j in jobs:
            j.kernel(*j.args, 0, j.rows)
        return
    cuts = n * _PIECES
    pieces = [(j, j.rows * i // cuts, j.rows * (i + 1) // cuts) for j in jobs for i in range(cuts)]
    pieces = [p for p in pieces if p[2] > p[1]]
    n = min(n, len(pieces))
    if n <= 1:
        _take_pieces(pieces, itertools.count())
        return
    turn = itertools.count()  # next() is atomic under the GIL: every piece is taken once
    pool = _helpers(n - 1)
    futures: list[Future] = [pool.submit(_take_pieces, pieces, turn) for _ in range(1, n)]
    try:
        _take_pieces(pieces, turn)
    finally:
        for f in futures:
            f.exception()  # wait for every thread before re-raising any error
    for f in futures:
        f.result()


def _take_pieces(pieces: Sequence[tuple[RowJob, int, int]], turn: Iterator[int]) -> None:
    """Run the pieces whose turn this thread takes, until none is left."""
    for i in turn:
        if i >= len(pieces):
            return
        job, r0, r1 = pieces[i]
        job.kernel(*job.args, r0, r1)


_PIECES = 2  # ranges per thread and job: enough to even out a slowed thread, few enough calls
_MIN_SPLIT = 1 << 19  # elements (2 MiB of float32): below, one thread copies them faster than a hand-off


def _helpers(count: int) -> ThreadPoolExecutor:
    """The process's helper pool, with at least ``count`` threads."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < count:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(max_workers=count, thread_name_prefix="fsdpx-rows"), count
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's helper threads do not exist here; make a new pool on use."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
