"""Compiled row loops run over their tensors' rows by the calling thread and helper threads.

ZenFlow's column copies on a CPU "device" (``offload.column_copy``) are loops over a weight's rows
that read and write only that row, compiled without the GIL (``numba.njit(nogil=True)``). One
thread reaches about half the memory bandwidth of two on this project's machines, while the
model's own operations (torch's intra-op threads) use every core. :func:`run_rows` gives the
loops the same threads: each job's rows are cut into as many contiguous ranges as the calling
thread's intra-op thread count, the first range runs on the calling thread, the others on helper
threads (one process-wide pool, made on first use and dropped in a forked child).

A row is processed by exactly one thread, once, with the same operations as a single loop, so
the result does not depend on the thread count (``tests/test_row_team.py``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


@dataclass(frozen=True)
class RowJob:
    """``kernel(*args, r0, r1)`` processes rows ``r0 <= r < r1`` of tensors with ``rows`` rows.
    ``kernel`` must release the GIL and touch, for row ``r``, only row ``r`` of its outputs."""

    kernel: Callable[..., None]
    args: tuple[Any, ...]
    rows: int


def run_rows(jobs: Sequence[RowJob], threads: int | None = None) -> None:
    """Run every job over all its rows; returns ``None`` once every row has run.

    ``threads`` (default: ``torch.get_num_threads()`` on the calling thread, so a worker thread
    that set its OpenMP count to 1 runs everything itself) ranges per job: range ``i`` of every
    job runs on thread ``i``, range 0 on the caller. Guarantee: each row of each job is processed
    exactly once, so for kernels as :class:`RowJob` requires the outputs equal one sequential
    ``kernel(*args, 0, rows)`` per job, bit for bit, for any ``threads``
    (``tests/test_row_team.py::test_any_thread_count_gives_the_sequential_bits``). Edge cases: no
    jobs, or jobs with fewer rows than threads (their empty ranges are skipped); a kernel's
    exception on any thread is re-raised here after every range has finished."""
    n = max(1, torch.get_num_threads() if threads is None else threads)
    n = min(n, max([j.rows for j in jobs] + [1]))  # no more ranges than the longest job's rows
    if n == 1:
        for j in jobs:
            j.kernel(*j.args, 0, j.rows)
        return
    pool = _helpers(n - 1)
    futures: list[Future] = [pool.submit(_run_range, jobs, i, n) for i in range(1, n)]
    try:
        _run_range(jobs, 0, n)
    finally:
        for f in futures:
            f.exception()  # wait for every range before re-raising any error
    for f in futures:
        f.result()


def _run_range(jobs: Sequence[RowJob], i: int, n: int) -> None:
    """Range ``i`` of ``n`` of every job: rows ``[rows * i // n, rows * (i + 1) // n)``."""
    for j in jobs:
        r0, r1 = j.rows * i // n, j.rows * (i + 1) // n
        if r1 > r0:
            j.kernel(*j.args, r0, r1)


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
