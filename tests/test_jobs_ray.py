"""The Ray backend of ``fsdpx jobs run`` (issue 13), on a local ``ray.init(num_cpus=2)`` shared
by this module's tests: the same plans and results as the local backend, failures reported,
nothing left behind by ``stop``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fsdpx.jobs as jobs
from fsdpx.jobs import techniques
from fsdpx.jobs.backends import Attempt, LocalBackend
from fsdpx.jobs.live import read_progress
from fsdpx.jobs.plan import Assignment, Option, Plan
from fsdpx.jobs.ray_backend import RayBackend, RayNotInstalledError, on_this_node, require_ray, resources
from fsdpx.jobs.runner import run_jobs

from support.jobs import CORES, attempt, check_segments, job_losses, tiny_gpt, toy, wait

TESTS = str(Path(__file__).resolve().parent)


def test_without_ray_the_backend_is_a_named_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds when it is not installed
    with pytest.raises(RayNotInstalledError, match=r"pip install fsdpx\[ray\]"):
        require_ray()
    with pytest.raises(ImportError, match=r"pip install fsdpx\[ray\]"):
        RayBackend()


def test_devices_on_the_node():
    cpu = Attempt(toy("a", 1), "counting", jobs.Devices(2, 2**30, ids=(3, 5)), {}, 1, Path("c"))
    assert resources(cpu) == {"num_cpus": 2}
    assert on_this_node(cpu, [], {0, 3, 5}).devices.ids == (3, 5)  # the runner's cores, on a local cluster
    assert on_this_node(cpu, [], {0, 1}).devices.ids is None  # another node: not pinned
    gpu = Attempt(toy("a", 1), "counting", jobs.Devices(2, 2**30, "cuda", ids=(0, 1)), {}, 1, Path("c"))
    assert resources(gpu) == {"num_cpus": 0, "num_gpus": 2}
    assert on_this_node(gpu, [6, 2], set()).devices.ids == (2, 6)  # the GPUs Ray chose
    with pytest.raises(ValueError, match="assigned GPUs"):
        on_this_node(gpu, [6], set())


# ---------------------------------------------------------------------------- on a local Ray cluster


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def backend(ray_session):
    # the toy techniques' classes live in tests/support/: the actors import them from there
    b = RayBackend(runtime_env={"env_vars": {"PYTHONPATH": TESTS}})
    yield b
    b.close()
    assert ray_session.is_initialized()  # close() leaves alone a Ray it did not start


def test_a_technique_that_raises_on_ray_is_reported_failed_and_the_other_completes(counting, backend, tmp_path):
    tasks = [toy("a", 20), toy("raises", 10)]
    options = {"a": [Option("counting", 1, 1.2, (), 0.2)], "raises": [Option("raising", 1, 0.7, (), 0.2)]}
    report = run_jobs(tasks, options, jobs.Devices(2, 2**30), tmp_path, backend=backend, stream=None,
                      solve_options={"time_limit": 1})
    out = report.jobs
    assert out["raises"].state == "failed" and "RuntimeError: raises cannot run here" in out["raises"].error
    assert out["a"].state == "done" and out["a"].error is None
    assert [json.loads(r)["step"] for r in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()] \
        == list(range(1, 21))
    seg = out["a"].segments[-1]  # pinned, in its Ray actor, to the core behind its plan device
    assert out["a"].result["cores"] == sorted({CORES[i % len(CORES)] for i in seg.devices})
    assert json.loads((tmp_path / "report.json").read_text())["jobs"]["raises"]["state"] == "failed"
    check_segments(report)


def test_an_attempt_larger_than_the_ray_cluster_fails_at_once(counting, backend, tmp_path):
    handle = backend.start(Attempt(toy("big", 5), "counting", jobs.Devices(3, 2**30), {}, 5, tmp_path / "ckpt"))
    kind, error = handle.poll()
    assert kind == "error" and "needs 3 CPUs; the Ray cluster has 2" in error


class SpawningTechnique:
    """Starts a child that starts a grandchild (both sleeping, ``marker`` in their command line),
    writes their pids to ``<ckpt_dir>/pids``, then waits: a job with processes of its own."""

    def feasible(self, task, devices):
        return True

    def search(self, task, devices):
        return {}

    def execute(self, task, devices, params, steps, ckpt_dir):
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        code = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(300)', sys.argv[1]]); print(g.pid, flush=True); time.sleep(300)")
        child = subprocess.Popen([sys.executable, "-c", code, str(ckpt_dir)], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        (Path(ckpt_dir) / "pids").write_text(json.dumps([os.getpid(), child.pid, grandchild]))
        child.wait()


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed and awaiting its reaper, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_stop_on_ray_leaves_no_process_behind(backend, tmp_path):
    jobs.register("spawning", SpawningTechnique(), replace=True)
    try:
        handle = backend.start(Attempt(toy("s", 5), "spawning", jobs.Devices(1, 2**30), {}, 5, tmp_path / "ckpt"))
        deadline = time.monotonic() + 60
        while not (tmp_path / "ckpt" / "pids").exists():
            assert handle.poll() is None and time.monotonic() < deadline, "the attempt never started its children"
            time.sleep(0.1)
        pids = json.loads((tmp_path / "ckpt" / "pids").read_text())
        actor, attempt_pid = backend._ray.get(handle.pids)
        assert attempt_pid == pids[0] and all(map(running, [actor, *pids]))
        handle.stop()
        assert not any(map(running, pids))  # the attempt and everything it started: gone when stop returns
        deadline = time.monotonic() + 10
        while running(actor):  # Ray's worker process that held the actor follows
            assert time.monotonic() < deadline, "the actor's process outlived stop() by 10 s"
            time.sleep(0.1)
    finally:
        techniques.unregister("spawning")


@pytest.mark.slow
def test_a_plan_with_a_builtin_job_runs_on_ray_as_it_runs_locally(counting, backend, tmp_path):
    """A user technique and a built-in (ddp on torchrun) planned on 2 devices and run through
    Ray: both complete; the GPT job logs the same losses, bit for bit, as the same attempt run
    by the local backend."""
    tasks = [toy("toy", 20), tiny_gpt("gpt", 8)]
    options = {"toy": [Option("counting", 1, 1.2, (), 0.2)], "gpt": [Option("ddp", 1, 10.0, (), 5.0)]}
    plan = Plan((Assignment("gpt", options["gpt"][0], 0.0, (0,)), Assignment("toy", options["toy"][0], 0.0, (1,))),
                2, 1.0, "given", 10.0)
    report = run_jobs(tasks, options, jobs.Devices(2, 2**30), tmp_path / "ray", plan=plan, backend=backend,
                      stream=None, replan=False)
    assert report.ok, {n: o.error for n, o in report.jobs.items()}
    assert report.jobs["gpt"].result.ok and report.jobs["toy"].result["cores"] == [CORES[1 % len(CORES)]]
    kind, alone = wait(LocalBackend().start(attempt(tasks[1], "ddp", 1, 8, tmp_path / "local")))
    assert kind == "ok" and alone.ok
    assert job_losses(tmp_path / "ray" / "gpt") == job_losses(tmp_path / "local" / "gpt") \
        and len(job_losses(tmp_path / "local" / "gpt")) == 8


@pytest.mark.slow
def test_stop_on_ray_kills_torchrun_and_its_workers(backend, tmp_path):
    """A built-in ddp job on 2 devices stopped mid-run through Ray: no process of it (torchrun,
    its workers) survives, and its files stop changing."""
    handle = backend.start(attempt(tiny_gpt("long", 400), "ddp", 2, 400, tmp_path))
    deadline = time.monotonic() + 120
    while read_progress(tmp_path / "long").step < 2:
        assert handle.poll() is None and time.monotonic() < deadline, "the job never started"
        time.sleep(0.2)
    mine = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tmp_path) in _cmdline(p)]
    assert len(mine) >= 3  # torchrun and its two workers
    handle.stop()
    deadline = time.monotonic() + 5  # SIGKILL'd at stop; the workers by PR_SET_PDEATHSIG as torchrun dies
    while alive := [p for p in mine if running(int(p.name))]:
        assert time.monotonic() < deadline, f"alive 5 s after stop: {[_cmdline(p) for p in alive]}"
        time.sleep(0.1)
    size = (tmp_path / "long" / "run" / "metrics.jsonl").stat().st_size
    time.sleep(2)
    assert (tmp_path / "long" / "run" / "metrics.jsonl").stat().st_size == size


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
