"""Helpers shared by the jobs tests: small jobs, attempts pinned to this machine's cores, waiting
for an attempt, reading what a run logged, and the checks every report must pass."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fsdpx.jobs as jobs
from fsdpx.jobs.backends import Attempt
from fsdpx.jobs.gpt_job import gpt_task
from fsdpx.jobs.runner import RunReport

CORES = sorted(os.sched_getaffinity(0))
"""The cores this process may run on, in order: where ``attempt`` pins its devices."""


def toy(name: str, steps: int) -> jobs.Task:
    """A job of ``steps`` steps whose functions are lambdas: runnable by a user technique only."""
    return jobs.Task(name, lambda h: None, lambda h: None, lambda o, t: None, steps=steps, batch_size=1)


def tiny_gpt(name: str, steps: int, **kw) -> jobs.Task:
    """A built-in GPT job (``gpt_task``) small enough to train in seconds on a CPU: one layer of
    width 32, batches of 16, a checkpoint every 5 steps; ``kw`` over those."""
    return gpt_task(name, steps=steps, batch_size=kw.pop("batch_size", 16), n_layer=kw.pop("n_layer", 1),
                    n_embd=kw.pop("n_embd", 32), n_head=2, corpus_chars=20000, ckpt_every=5, **kw)


# Four jobs of different sizes, one private: (name, steps, tiny_gpt keywords)
FOUR_JOBS = (("tiny", 60, {}), ("small", 40, {"n_layer": 2, "n_embd": 48}), ("wide", 30, {"n_embd": 64, "batch_size": 32}),
             ("private", 40, {"privacy": jobs.Privacy(target_epsilon=8.0)}))


def wait(handle, timeout: float = 300):
    """What a backend attempt's ``handle.poll()`` returns once it has ended; fails the test
    after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (msg := handle.poll()) is None:
        assert time.monotonic() < end, "attempt did not finish"
        time.sleep(0.1)
    return msg


def run_losses(run_dir: Path) -> list[float]:
    """The per-step losses a run logged in ``run_dir/metrics.jsonl``."""
    return [json.loads(r)["loss"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def job_losses(job_dir: Path) -> list[float]:
    """The per-step losses a job logged in ``job_dir/run/metrics.jsonl``."""
    return run_losses(job_dir / "run")


def attempt(task, technique: str, n: int, steps: int, root: Path, first_core: int = 0) -> Attempt:
    """An attempt of ``task`` by ``technique`` on ``n`` devices pinned to this machine's cores (in
    turn, from ``CORES[first_core]``), ``steps`` steps, checkpoints under ``root/<task>/ckpt``."""
    ids = tuple(CORES[(first_core + i) % len(CORES)] for i in range(n))
    return Attempt(task, technique, jobs.Devices(n, 2**30, ids=ids), {}, steps, root / task.name / "ckpt")


def check_segments(report: RunReport) -> None:
    """Segments overlapping in time hold disjoint devices; each job's segments continue one
    another from a checkpoint (no step lost before it)."""
    segs = [s for o in report.jobs.values() for s in o.segments]
    for x in segs:
        for y in segs:
            if x is not y and x.start < y.end - 0.05 and y.start < x.end - 0.05:  # 50 ms: poll granularity
                assert not set(x.devices) & set(y.devices), (x, y)
    for o in report.jobs.values():
        for prev, nxt in zip(o.segments, o.segments[1:]):
            assert nxt.step_from <= prev.step_to and nxt.start >= prev.end
