"""offload.row_team: row loops split over threads give the bits of one sequential loop."""

from __future__ import annotations

import os
import threading
import time

import numba
import numpy as np
import pytest

from offload.row_team import RowJob, run_rows


@numba.njit(nogil=True, cache=True)
def _running_sum(src, out, r0, r1):  # noqa: ANN001, ANN202
    """Row r of out: the running sum of row r of src (order-dependent rounding within a row)."""
    for r in range(r0, r1):
        acc = np.float32(0.0)
        for j in range(src.shape[1]):
            acc = acc + src[r, j]
            out[r, j] = acc


def _jobs(rows_list, seed=0):
    rng = np.random.default_rng(seed)
    srcs = [rng.standard_normal((rows, 37)).astype(np.float32) * 1e3 for rows in rows_list]
    outs = [np.full_like(s, np.nan) for s in srcs]
    return [RowJob(_running_sum, (s, o), s.shape[0]) for s, o in zip(srcs, outs)], outs


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_any_thread_count_gives_the_sequential_bits(threads):
    """Every row of every job (row counts 0, 1, fewer than the threads, odd, many) is written
    once, with the bits of a single loop over all rows."""
    rows_list = [0, 1, 2, 7, 301]
    jobs, outs = _jobs(rows_list)
    run_rows(jobs, threads)
    ref_jobs, refs = _jobs(rows_list)
    for j in ref_jobs:
        j.kernel(*j.args, 0, j.rows)
    for out, ref in zip(outs, refs):
        assert not np.isnan(out).any()
        assert np.array_equal(out, ref)
    empty, _ = _jobs([0, 0])
    run_rows(empty, threads)  # jobs with no rows at all: nothing to run, no error
    run_rows([], threads)


def test_ranges_run_on_the_caller_and_helper_threads():
    """With 3 threads a job's rows are cut into ranges that cover them once, taken by the caller
    and by helper threads: the split is real, not one loop on the caller."""
    seen: list[tuple[int, int, int]] = []

    def record(r0, r1):  # noqa: ANN001, ANN202
        seen.append((r0, r1, threading.get_ident()))
        time.sleep(0.02)  # releases the GIL, as a compiled nogil loop does

    run_rows([RowJob(record, (), 12)], threads=3)
    ranges = sorted((r0, r1) for r0, r1, _ in seen)
    assert [r for r0, r1 in ranges for r in range(r0, r1)] == list(range(12))
    caller = threading.get_ident()
    assert any(t == caller for *_, t in seen) and any(t != caller for *_, t in seen)


def test_a_small_batch_runs_on_the_caller_alone():
    """Jobs that say they touch few elements (a column copy of a narrow slice) are not handed to
    helper threads: the hand-off would cost more than it saves."""
    seen: list[int] = []
    run_rows([RowJob(lambda r0, r1: seen.append(threading.get_ident()), (), 12, size=100)] * 2, threads=3)
    assert seen == [threading.get_ident()] * 2


def test_a_failing_range_is_raised_after_every_range_ran():
    ran = []

    def kernel(r0, r1):  # noqa: ANN001, ANN202
        ran.append(r0)
        time.sleep(0.01)
        if r0 >= 6:
            raise ValueError(f"rows from {r0}")

    with pytest.raises(ValueError, match="rows from"):
        run_rows([RowJob(kernel, (), 12)], threads=2)
    assert sorted(ran) == [0, 3, 6, 9]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_helpers():
    """The parent's helper threads do not exist in a forked child: the child's call still
    finishes (a pool inherited as it was would never run its ranges)."""
    run_rows([RowJob(lambda r0, r1: None, (), 4)], threads=2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if both ranges ran
        try:
            ran = []
            run_rows([RowJob(lambda r0, r1: ran.append(r0), (), 4)], threads=2)
            os._exit(0 if sorted(ran) == [0, 1, 2, 3] else 1)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
