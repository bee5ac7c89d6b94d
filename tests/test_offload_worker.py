"""offload.worker.submit: a job's intra-op thread count is its own, the caller's is untouched."""

from __future__ import annotations

import threading

import torch

from offload import worker


def test_a_job_runs_on_the_threads_it_asks_for_and_leaves_every_other_count_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        own = worker.submit(torch.get_num_threads).result()  # the background thread's count (fixed at its start)
        assert worker.submit(torch.get_num_threads, threads=1).result() == 1
        assert torch.get_num_threads() == 2  # the caller's count
        assert worker.submit(torch.get_num_threads).result() == own  # put back after the job
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # a thread started afterwards
        t.start()
        t.join()
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


def test_jobs_with_and_without_a_thread_count_run_in_submission_order():
    order = []
    gate = threading.Event()
    jobs = [worker.submit(gate.wait), worker.submit(order.append, 1, threads=1), worker.submit(order.append, 2),
            worker.submit(order.append, 3, threads=1)]
    gate.set()
    for j in jobs:
        j.result()
    assert order == [1, 2, 3]
