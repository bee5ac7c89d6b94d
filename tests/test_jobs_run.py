"""Executing plans for real (issue 13: ``fsdpx jobs run``): ``fsdpx.jobs.runner``, the local
backend and the re-planning they share with the simulation (``fsdpx.jobs.replan``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fsdpx.jobs as jobs
from fsdpx.jobs import techniques
from fsdpx.jobs.backends import LocalBackend
from fsdpx.jobs.live import read_progress
from fsdpx.jobs.plan import Assignment, Option, Plan
from fsdpx.jobs.replan import Running, keep_placement, remaining_options, replan, same_choice, stays
from fsdpx.jobs.runner import run_jobs

from support.counting_technique import CountingTechnique
from support.jobs import CORES, FOUR_JOBS, attempt, check_segments, job_losses, tiny_gpt, toy, wait
from support.processes import python_env
# ---------------------------------------------------------------------------- pure: re-planning


def test_remaining_options_rescale_the_steps_left():
    opts = {"a": [Option("t", 1, 12.0, (), 2.0), Option("t", 2, 7.0, (), 2.0)]}
    assert remaining_options(opts, {"a": 10}, {"a": 10}) == opts
    half = remaining_options(opts, {"a": 10}, {"a": 5}, {"a": 2.0})
    assert half["a"] == [Option("t", 1, 2.0 + 5 * 1.0 * 2, (), 2.0), Option("t", 2, 2.0 + 5 * 0.5 * 2, (), 2.0)]
    # running on one device with 3 steps left: staying costs 3 steps and no startup; a move
    # restarts from its checkpoint (5 left) and pays the startup again
    stay = remaining_options(opts, {"a": 10}, {"a": 5}, running={"a": Running(opts["a"][0], (1,), 3)})
    assert stay["a"] == [Option("t", 1, 3.0, (), 0.0), Option("t", 2, 4.5, (), 2.0)]
    assert remaining_options(opts, {"a": 10}, {"a": 0}) == {}
    with pytest.raises(ValueError, match="'b'"):
        remaining_options(opts, {"a": 10}, {"b": 3})


def test_a_running_job_that_stays_keeps_its_devices():
    o1, o2 = Option("t", 1, 5.0), Option("t", 2, 3.0)
    plan = Plan((Assignment("a", o1, 0.0, (0,)), Assignment("b", o1, 0.0, (1,)), Assignment("c", o2, 5.0, (0, 1)),
                 Assignment("d", o1, 0.0, (2,))), 4, 1.0, "greedy", 8.0)
    running = {"a": Running(o1, (3,), 4), "b": Running(o2, (0, 1), 2)}  # b's plan changes its count: a move
    kept = keep_placement(plan, running)
    assert stays(plan, running) == {"a"}
    assert kept.by_job()["a"].device_ids == (3,)
    ids = [set(a.device_ids) for a in kept.assignments if a.start == 0.0]
    assert sum(map(len, ids)) == len(set().union(*ids))  # still disjoint
    assert sorted(len(a.device_ids) for a in kept.assignments) == [1, 1, 1, 2]


def test_a_running_job_is_never_paused_at_the_price_of_staying():
    """``slow`` (drifted x3) should move to both devices; ``steady`` runs with 7 steps left, 10
    from its checkpoint. Greedy puts ``slow`` first and ``steady`` after it at its staying price
    (0.35 s, no startup) -- a restart priced as a stay. The re-plan lets ``steady`` finish now
    (0.35 + 4.09 s) rather than restart it later (4.09 + 0.2 + 0.5 s)."""
    options = {"slow": [Option("t", n, 0.2 + 60 * 0.05 / n, (), 0.2) for n in (1, 2)],
               "steady": [Option("u", 1, 0.2 + 50 * 0.05, (), 0.2)]}
    running = {"slow": Running(options["slow"][0], (0,), 45), "steady": Running(options["steady"][0], (1,), 7)}
    args = (options, {"slow": 60, "steady": 50}, {"slow": 50, "steady": 10}, 2)
    plan = replan(*args, factor={"slow": 3.0}, running=running, solve_options={"use_milp": False, "search_budget": 0})
    got = plan.by_job()
    assert (got["steady"].start, got["steady"].device_ids, got["steady"].option.seconds) == (0.0, (1,), 0.35000000000000003)
    assert got["slow"].option.devices == 2 and got["slow"].start == pytest.approx(0.35)
    assert stays(plan, running) == {"steady"} and any("placed later" in n for n in plan.notes)
    for fac in (1.0, 2.0, 3.0, 5.0):  # whatever the solver picks: a kept choice starts now or pays its restart
        for a in replan(*args, factor={"slow": fac}, running=running, solve_options={"time_limit": 1}).assignments:
            if same_choice(a.option, running[a.job].option):
                assert a.start == 0.0 or a.option.startup > 0, (fac, a)


# ---------------------------------------------------------------------------- a user technique


def test_a_technique_that_raises_is_reported_failed_and_the_others_complete(counting, tmp_path):
    tasks = [toy("a", 30), toy("b", 20), toy("raises", 10), toy("exits", 10)]
    opt = lambda tech, steps: [Option(tech, n, 0.2 + steps * 0.05 / n, (), 0.2) for n in (1, 2)]  # noqa: E731
    options = {"a": opt("counting", 30), "b": opt("counting", 20), "raises": opt("raising", 10),
               "exits": opt("exiting", 10)}
    report = run_jobs(tasks, options, jobs.Devices(2, 2**30), tmp_path, stream=None, solve_options={"time_limit": 1})
    out = report.jobs
    assert out["raises"].state == "failed" and "RuntimeError: raises cannot run here" in out["raises"].error
    assert out["exits"].state == "failed" and "exited with code 3" in out["exits"].error
    for name, steps in (("a", 30), ("b", 20)):
        assert out[name].state == "done" and out[name].error is None
        assert [json.loads(r)["step"] for r in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()] \
            == list(range(1, steps + 1))
        # pinned to the cores behind its plan devices
        seg = out[name].segments[-1]
        assert out[name].result["cores"] == sorted({CORES[i % len(CORES)] for i in seg.devices})
    assert not report.ok and any("raises failed" in r.reason for r in report.replans)
    check_segments(report)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["jobs"]["raises"]["state"] == "failed" and saved["jobs"]["a"]["result"]["devices"] >= 1


def test_a_job_finishing_early_replans_and_a_job_moves_by_checkpoint(counting, tmp_path):
    """``short`` is planned at 20 s but takes 1 s: the re-plan moves ``long`` from one device
    to both, restarting it from its newest checkpoint; its steps are logged exactly once."""
    tasks = [toy("long", 80), toy("short", 20)]
    options = {"long": [Option("counting", n, 0.2 + 80 * 0.05 / n, (), 0.2) for n in (1, 2)],
               "short": [Option("counting", 1, 20.0, (), 0.2)]}
    plan = Plan((Assignment("long", options["long"][0], 0.0, (0,)), Assignment("short", options["short"][0], 0.0, (1,))),
                2, 1.0, "given", 20.0)
    report = run_jobs(tasks, options, jobs.Devices(2, 2**30), tmp_path, plan=plan, stream=None,
                      solve_options={"time_limit": 1})
    assert report.ok
    replan = report.replans[1]
    assert replan.reason.startswith("short finished") and replan.moved == ("long",)
    first, second = report.jobs["long"].segments
    assert (first.how, first.devices, second.devices) == ("moved", (0,), (0, 1))
    assert second.step_from == first.step_to - first.step_to % 5 > 0  # from its newest checkpoint
    rows = [json.loads(r) for r in (tmp_path / "long" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 81)) and rows[-1]["loss"] == 1 / 80
    assert report.jobs["long"].result["devices"] == 2
    check_segments(report)


def test_a_drifting_job_replans_once_with_its_measured_pace(counting, tmp_path):
    """``slow``'s steps take 3x its profile (timed by the runner: it logs no clock); ``steady``
    keeps its profile's pace (on its own clock). Once ``slow``'s pace is measured the work left
    is re-planned with that factor, which moves ``slow`` from one device to both; it re-plans
    no more (its pace on two devices is what the new plan assumed), and ``steady`` never does."""
    jobs.register("dragging", CountingTechnique(seconds_per_step=0.15), replace=True)
    jobs.register("steady", CountingTechnique(clock=True), replace=True)
    try:
        tasks = [toy("slow", 60), toy("steady", 50)]
        options = {"slow": [Option("dragging", n, 0.2 + 60 * 0.05 / n, (), 0.2) for n in (1, 2)],
                   "steady": [Option("steady", 1, 0.2 + 50 * 0.05, (), 0.2)]}
        plan = Plan((Assignment("slow", options["slow"][0], 0.0, (0,)),
                     Assignment("steady", options["steady"][0], 0.0, (1,))), 2, 1.0, "given", 3.2)
        report = run_jobs(tasks, options, jobs.Devices(2, 2**30), tmp_path, plan=plan, stream=None,
                          solve_options={"time_limit": 1})
    finally:
        techniques.unregister("dragging")
        techniques.unregister("steady")
    assert report.ok
    drifts = [r for r in report.replans if "steps take" in r.reason]
    assert len(drifts) == 1 and drifts[0].reason.startswith("slow steps take x") and drifts[0].moved == ("slow",)
    factor = drifts[0].factors["slow"]
    assert factor == pytest.approx(3.0, rel=0.2) and "steady" not in drifts[0].factors
    first, second = report.jobs["slow"].segments
    assert (first.how, first.devices, second.devices) == ("moved", (0,), (0, 1))
    assert second.step_from == first.step_to - first.step_to % 5 > 0  # from its newest checkpoint
    moved = drifts[0].plan.by_job()["slow"].option
    left = (moved.seconds - moved.startup) / (0.05 / 2 * factor)  # the steps it was planned for, at the measured pace
    assert moved.devices == 2 and 60 - second.step_from - 1e-6 <= left <= 60 - second.step_from + 5 + 1e-6
    rows = [json.loads(r)["step"] for r in (tmp_path / "slow" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 61))
    check_segments(report)


def test_a_job_finishing_its_last_checkpointed_step_is_left_to_end(counting, tmp_path):
    """``a`` has trained and checkpointed all its steps and is still ending (3 s) when ``b``'s
    early finish re-plans: ``a`` is not moved (there is nothing left to move), it ends where it is."""
    jobs.register("lingering", CountingTechnique(linger=3.0), replace=True)
    tasks = [toy("a", 5), toy("b", 10)]
    options = {"a": [Option("lingering", 1, 4.0, (), 0.2)], "b": [Option("counting", 1, 20.0, (), 0.2)]}
    plan = Plan((Assignment("a", options["a"][0], 0.0, (0,)), Assignment("b", options["b"][0], 0.0, (1,))),
                2, 1.0, "given", 20.0)
    out: list = []
    thread = threading.Thread(target=lambda: out.append(run_jobs(tasks, options, jobs.Devices(2, 2**30), tmp_path,
                                                                 plan=plan, stream=None)), daemon=True)
    try:
        thread.start()
        thread.join(60)  # before the fix, a was "moved" out of every plan and the run never ended
    finally:
        techniques.unregister("lingering")
    assert out, "the run did not end"
    report = out[0]
    assert report.ok and [r.reason.split()[:2] for r in report.replans[1:]] == [["b", "finished"]]
    assert [(s.how, s.step_to) for s in report.jobs["a"].segments] == [("done", 5)] and report.replans[1].moved == ()


def test_bad_runs_are_named_errors_before_anything_starts(counting, tmp_path):
    options = {"a": [Option("counting", 1, 1.0)]}
    with pytest.raises(jobs.DuplicateJobError):
        run_jobs([toy("a", 5), toy("a", 5)], options, jobs.Devices(1, 2**30), tmp_path, stream=None)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        run_jobs([toy("a", 5), toy("b", 5)], options, jobs.Devices(1, 2**30), tmp_path, stream=None)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- real jobs (torchrun)


@pytest.mark.slow
def test_a_moved_job_continues_bit_for_bit_with_its_technique(tmp_path):
    """A private ddp job stopped mid-run (its processes killed, as a move does) and restarted
    from its checkpoint on the same count logs the unmoved run's losses bit for bit; restarted
    on another count, the same within float rounding."""
    task = tiny_gpt("m", 16, privacy=jobs.Privacy(target_epsilon=8.0))
    backend = LocalBackend()
    unmoved, ref = backend.start(attempt(task, "ddp-private", 2, 16, tmp_path / "ref")), None  # side by side
    try:
        for n in (2, 1):
            root = tmp_path / f"moved{n}"
            handle = backend.start(attempt(task, "ddp-private", 2, 16, root))
            while read_progress(root / "m").step < 7:
                assert handle.poll() is None, "the first attempt ended before it could be moved"
                time.sleep(0.05)
            handle.stop()
            assert 5 <= read_progress(root / "m").step < 16
            kind, result = wait(backend.start(attempt(task, "ddp-private", n, 16, root)))
            assert kind == "ok" and result.ok, result
            if ref is None:
                kind, ref = wait(unmoved)
                assert kind == "ok" and ref.ok, ref
            got, want = job_losses(root / "m"), job_losses(tmp_path / "ref" / "m")
            assert len(got) == 16
            if n == 2:
                assert got == want
            else:
                assert got[:5] == want[:5] and got == pytest.approx(want, rel=1e-5)
            assert result.summary["epsilon"] == pytest.approx(ref.summary["epsilon"], rel=1e-9)
    finally:
        if ref is None:  # the test failed before the unmoved run was waited for: nothing left running
            unmoved.stop()


def _wait_for_quiet(below: float, *, limit_s: float) -> None:
    """Wait until the 1-minute load average is below ``below``, at most ``limit_s`` seconds: it
    decays with a one-minute time constant, so right after other work (the set-up's install,
    tests run just before) it still reads 2-3 on an idle machine."""
    end = time.monotonic() + limit_s
    while os.getloadavg()[0] >= below and time.monotonic() < end:
        time.sleep(2.0)


@pytest.mark.slow
@pytest.mark.alone  # the makespan bound needs the cores: run before the parallel suite (tests/conftest.py)
def test_four_real_jobs_equal_their_solo_runs_and_the_predicted_makespan(tmp_path):
    """Issue 13, section 2.3: four small jobs (different sizes, one private) planned from real
    profiles (measured side by side, pinned, as the plan runs them) on this machine's 2 cores and
    run with the local backend: every job's losses equal those of the same job run alone with
    the same technique and count (bit for bit; within 1e-5 relative for a job a re-plan moved to
    another count), and the measured makespan is within 20% of the plan's (the issue's target).
    The bound is checked only when the load average stayed below the cores + 0.5: these jobs
    are mostly start-up, and other processes' load changes start-up from one minute to the next
    (``benchmarks/planner.py --real``: +3% to +19% at loads 1.2-4.5 in 6 repeats, up to +230% at
    loads 6-12 when other sessions' benchmarks shared the 2 cores)."""
    from fsdpx.jobs.cli import profiled_options

    if os.environ.get("FSDPX_TESTS") == "alone":  # make test's alone phase: earlier work's load may still decay
        _wait_for_quiet(len(CORES) / 2, limit_s=120.0)
    tasks = [tiny_gpt(name, steps, **kw) for name, steps, kw in FOUR_JOBS]
    cluster = jobs.Devices(2, 2**30)
    load = os.getloadavg()[0]
    options, _ = profiled_options(tasks, cluster, {1}, tmp_path / "profiles", ["ddp", "ddp-private"])
    report = run_jobs(tasks, options, cluster, tmp_path / "run", stream=None, solve_options={"time_limit": 2})
    load = max(load, os.getloadavg()[0])  # while the plan ran (the solo runs below are not its conditions)
    assert report.ok, {n: o.error for n, o in report.jobs.items()}
    check_segments(report)
    backend = LocalBackend()
    firsts = {t.name: report.jobs[t.name].segments[0] for t in tasks}
    assert all(len(f.devices) == 1 for f in firsts.values())  # profiled on 1 device only
    solo = {}
    for pair in (tasks[:2], tasks[2:]):  # two solo runs at a time, each pinned to a core of its own
        started = {t.name: backend.start(attempt(t, firsts[t.name].technique, 1, t.steps, tmp_path / "alone", i))
                   for i, t in enumerate(pair)}
        solo.update({name: wait(handle) for name, handle in started.items()})
    for task in tasks:
        segs = report.jobs[task.name].segments
        first = firsts[task.name]
        kind, alone = solo[task.name]
        assert kind == "ok" and alone.ok
        got, want = job_losses(tmp_path / "run" / task.name), job_losses(tmp_path / "alone" / task.name)
        if all((s.technique, len(s.devices)) == (first.technique, len(first.devices)) for s in segs):
            assert got == want
            assert report.jobs[task.name].result.summary["final_loss"] == alone.summary["final_loss"]
        else:  # moved by a re-plan (a drift) to another count: the same up to float rounding
            assert got == pytest.approx(want, rel=1e-5)
    print(f"predicted makespan {report.predicted:.1f} s, measured {report.makespan:.1f} s, load {load:.1f}")
    if load > len(CORES) + 0.5:  # other processes on the cores: the profiles do not describe this machine now
        pytest.skip(f"load average {load:.1f} on {len(CORES)} cores: makespan {report.makespan:.1f} s measured vs"
                    f" {report.predicted:.1f} s planned is not a test of the plan (the losses were checked)")
    assert report.makespan == pytest.approx(report.predicted, rel=0.2)


@pytest.mark.slow
def test_the_runner_takes_its_jobs_processes_with_it(tmp_path):
    """SIGKILL of a runner mid-run: no job process, torchrun or worker of it is alive 10 s
    later (none once they are gone, checked at once and 2 s later), and the jobs' files stop
    changing."""
    script = f"""
from pathlib import Path
import fsdpx.jobs as jobs
from fsdpx.jobs.plan import Option
from fsdpx.jobs.runner import run_jobs
from support.jobs import tiny_gpt
tasks = [tiny_gpt("a", 400), tiny_gpt("b", 400)]
run_jobs(tasks, {{t.name: [Option("ddp", 1, 60.0)] for t in tasks}}, jobs.Devices(2, 2**30), Path({str(tmp_path)!r}),
         stream=None)
"""
    runner = subprocess.Popen([sys.executable, "-c", script], env=python_env())
    try:
        deadline = time.monotonic() + 120
        while not all(read_progress(tmp_path / j).step >= 2 for j in "ab"):
            assert runner.poll() is None and time.monotonic() < deadline, "the jobs never started"
            time.sleep(0.2)
    finally:
        runner.kill()
        runner.wait()
    # gone within 10 s (polled: the test goes on as soon as they are), and once gone none comes back
    deadline = time.monotonic() + 10
    while (mine := _mine(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mine == []
    sizes = [(tmp_path / j / "run" / "metrics.jsonl").stat().st_size for j in "ab"]
    time.sleep(2)
    assert sizes == [(tmp_path / j / "run" / "metrics.jsonl").stat().st_size for j in "ab"]
    assert _mine(tmp_path) == []


def _mine(tmp_path: Path) -> list[Path]:
    """The live processes whose command line names ``tmp_path`` (a job's process, torchrun or worker)."""
    return [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tmp_path) in _cmdline(p)]


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
