"""Profiles: measured steps, the disk cache and predictions for unprofiled counts (issue 13)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import fsdpx.jobs as jobs
from fsdpx.jobs.builtin import BUILTIN
from fsdpx.jobs.gpt_job import gpt_task
from fsdpx.jobs.profile import Measurement, ProfileTable, StepModel, fit_step_model, sent_bytes
from fsdpx.jobs.profile_store import cache_key, profile, profile_side_by_side
from fsdpx.jobs.solver import solve


def small(name: str = "a", **kw) -> jobs.Task:
    hparams = {"n_layer": 1, "n_embd": 32, "n_head": 2, "corpus_chars": 4000, **kw}
    return gpt_task(name, steps=hparams.pop("steps", 10), batch_size=16, **hparams)


def test_the_step_model_recovers_its_coefficients():
    truth = StepModel(compute=2.0, per_byte=1e-9, fixed=0.05)
    points = [(n, s, truth.seconds(n, s)) for n, s in ((1, 0), (2, 3_000_000), (4, 5_000_000), (8, 6_000_000))]
    got = fit_step_model(points)
    for n, s, t in points:
        assert got.seconds(n, s) == pytest.approx(t, rel=1e-6)
    assert got.compute == pytest.approx(2.0, rel=1e-6) and got.fixed == pytest.approx(0.05, rel=1e-5)
    assert fit_step_model([(2, 100, 1.5)]) == StepModel(3.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_step_model([])


def test_predictions_fill_unprofiled_counts_and_feed_the_solver():
    task = small()
    table = ProfileTable()
    sent = {n: sent_bytes(task, "zero3", n) for n in (1, 2, 4, 8)}
    truth = StepModel(0.8, 2e-8, 0.01)
    for n in (1, 2, 4):
        table.add("a", "zero3", n, Measurement(truth.seconds(n, sent[n]), 1000 + n))
    pred = table.predict(task, "zero3", "zero3", [1, 2, 4, 8])
    assert pred[8].measured is False and pred[8].step_seconds == pytest.approx(truth.seconds(8, sent[8]), rel=1e-4)
    errors = table.fit_errors(task, "zero3", "zero3")  # each point from the two others
    assert set(errors) == {1, 2, 4}
    table.add("a", "zero3", 8, Measurement(truth.seconds(8, sent[8]), 1008))
    assert max(table.fit_errors(task, "zero3", "zero3").values()) < 1e-4  # three others pin the model
    lone = ProfileTable()
    lone.add("a", "zero3", 2, Measurement(1.0, 1))
    assert lone.fit_errors(task, "zero3", "zero3") == {}
    options = table.options([task])
    assert [o.devices for o in options["a"]] == [1, 2, 4, 8]
    assert options["a"][0].seconds == pytest.approx(10 * truth.seconds(1, sent[1]))
    assert solve(options, 8, time_limit=1.0).assignments[0].job == "a"


class CountingTechnique:
    """A user's technique that trains nothing and counts how often it runs (for the cache)."""

    def __init__(self):
        self.runs = 0

    def feasible(self, task, devices):
        return True

    def search(self, task, devices):
        return {}

    def execute(self, task, devices, params, steps, ckpt_dir):
        self.runs += 1
        raise RuntimeError("boom")


def test_a_failed_profiling_run_is_an_error_naming_the_job(tmp_path):
    tech = jobs.register("counting", CountingTechnique())
    try:
        with pytest.raises(RuntimeError, match="boom"):
            profile(small("f"), "counting", jobs.Devices(1, 2**30), root=tmp_path)
        assert tech.runs == 1 and not list(tmp_path.iterdir())  # a failure is not cached
    finally:
        jobs.techniques.unregister("counting")


@dataclass(frozen=True)
class Ran:
    """What ``execute`` returns, as the built-ins' ``JobResult`` does (what profiling reads)."""

    run_dir: str
    seconds: float
    peak_bytes: tuple[int, ...]
    ok: bool = True


class TimedTechnique:
    """Sleeps ``seconds`` per step and logs each step's clock as the built-ins do; writes the
    cores it ran on and when (``time.time``: comparable across processes) to ``log/<job>.json``."""

    def __init__(self, log: Path, seconds: float = 0.1, fail: str = ""):
        self.log, self.seconds, self.fail = log, seconds, fail

    def feasible(self, task, devices):
        return True

    def search(self, task, devices):
        return {}

    def execute(self, task, devices, params, steps, ckpt_dir):
        if task.name == self.fail:
            raise RuntimeError(f"{task.name} breaks")
        began, t0 = time.time(), time.perf_counter()
        run = Path(ckpt_dir).parent / "run"
        run.mkdir(parents=True)
        with open(run / "metrics.jsonl", "w") as f:
            last = t0
            for s in range(1, steps + 1):
                time.sleep(self.seconds)
                now = time.perf_counter()
                f.write(json.dumps({"step": s, "step_seconds": now - last, "elapsed_seconds": now - t0}) + "\n")
                last = now
        (self.log / f"{task.name}-{steps}.json").write_text(json.dumps(
            {"cores": sorted(os.sched_getaffinity(0)), "began": began, "ended": time.time()}))
        return Ran(str(run), time.perf_counter() - t0 + 0.5, (100,))


def test_profiles_run_side_by_side_on_disjoint_cores(tmp_path):
    """Four 1-device profiles on a 2-device cluster run two at a time, each pinned to a core of
    its own, after one untimed step of the smallest job (the technique's warm-up: a fresh
    install's first run compiles what later runs reuse); their measurements are ``profile``'s;
    a cached one is not run again; a failure names its job, stops the others and caches nothing
    of them."""
    cores = sorted(os.sched_getaffinity(0))
    log = tmp_path / "log"
    log.mkdir()
    cluster = jobs.Devices(2, 2**30)
    jobs.register("timed", TimedTechnique(log))
    try:
        tasks = [small(f"j{i}", n_embd=32 + 8 * i) for i in range(4)]  # four jobs: four cache keys
        got = profile_side_by_side([(t, "timed", 1) for t in tasks], cluster, root=tmp_path / "p", steps=4)
        assert set(got) == {(f"j{i}", "timed", 1) for i in range(4)}
        for m in got.values():
            assert m.step_seconds == pytest.approx(0.1, abs=0.05) and m.startup_seconds == pytest.approx(0.5, abs=0.2)
        assert len(list((tmp_path / "p").glob("*.json"))) == 4
        runs = {p.stem: json.loads(p.read_text()) for p in log.glob("*.json")}
        assert sorted(runs) == ["j0-1", "j0-4", "j1-4", "j2-4", "j3-4"]  # the warm-up: j0 has the fewest parameters
        warm = runs.pop("j0-1")
        assert all(warm["ended"] <= r["began"] for r in runs.values())  # ended before anything was timed
        for p in log.glob("*.json"):
            p.unlink()
        assert profile_side_by_side([(t, "timed", 1) for t in tasks], cluster, root=tmp_path / "p") == got
        assert not list(log.glob("*.json"))  # all from the cache: nothing ran
        jobs.register("timed", TimedTechnique(log, fail="j5"), replace=True)
        with pytest.raises(RuntimeError, match="'j5'.*j5 breaks"):
            profile_side_by_side([(small("j4", steps=50), "timed", 1), (small("j5", n_embd=64), "timed", 1)], cluster,
                                 root=tmp_path / "f", steps=50)
        assert [p.name for p in log.glob("*.json")] == ["j4-1.json"]  # the warm-up ended; j4's profile was stopped
        assert not list(tmp_path.glob("f/*.json"))  # and nothing cached
    finally:
        jobs.techniques.unregister("timed")
    assert all(len(r["cores"]) == 1 and r["cores"][0] in cores[:2] for r in runs.values())
    overlapping = [(a, b) for a in runs for b in runs if a < b
                   and runs[a]["began"] < runs[b]["ended"] and runs[b]["began"] < runs[a]["ended"]]
    if len(cores) >= 2:
        assert overlapping  # side by side
    assert all(runs[a]["cores"] != runs[b]["cores"] for a, b in overlapping)


def test_the_cache_key_separates_counts_params_hardware_and_jobs():
    task, d = small(), jobs.Devices(2, 2**30)
    base = cache_key(task, "zero3", {}, d)
    assert base == cache_key(small(), "zero3", {}, d)  # an equal job, another object: same key
    assert len({base, cache_key(task, "zero3", {}, d.group(4)), cache_key(task, "zero2", {}, d),
                cache_key(task, "zero3", {"offload_topk": 0.5}, d), cache_key(task, "zero3", {}, jobs.Devices(2, 2**31)),
                cache_key(small(n_embd=64), "zero3", {}, d)}) == 6


@pytest.mark.slow
def test_profiling_runs_real_steps_once_then_reads_the_cache(tmp_path):
    task = small("p", privacy=jobs.Privacy(target_epsilon=4.0))
    m = profile(task, "zero2-private", jobs.Devices(2, 2**30), root=tmp_path, steps=3)
    assert m.measured and m.step_seconds > 0 and m.peak_bytes > 0
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    again = profile(task, "zero2-private", jobs.Devices(2, 2**30), root=tmp_path, steps=3)
    assert again == m and list(tmp_path.iterdir()) == files
    assert BUILTIN["zero2-private"].feasible(task, jobs.Devices(2, 2**30))


def test_the_prediction_check_is_explained_in_words():
    """Issue 28: ``fsdpx jobs plan`` printed "prediction error at each from the others 1: 531.4%"
    and nothing else. The report now says what was profiled, how other counts are predicted,
    and each profiled count's prediction from the others beside its measurement."""
    from fsdpx.jobs.cli import fit_report

    task, table = small(), ProfileTable()
    table.add("a", "zero3", 1, Measurement(0.12, 1))
    table.add("a", "zero3", 2, Measurement(0.76, 1))
    checks = table.cross_checks(task, "zero3", "zero3")
    assert {n: c.others for n, c in checks.items()} == {1: (2,), 2: (1,)}
    assert checks[1].predicted == pytest.approx(2 * 0.76) and checks[1].error == pytest.approx(2 * 0.76 / 0.12 - 1)
    assert table.fit_errors(task, "zero3", "zero3") == {n: c.error for n, c in checks.items()}
    text = fit_report("a", "zero3", table.measured("a", "zero3"), checks)
    assert text.startswith("a / zero3: profiled on 1 and 2 devices: 0.12 s and 0.76 s a step. Other device counts"
                           " are predicted by fitting step time = compute / devices")
    assert "predicted from the other profiles alone, on 1 device 1.52 s a step, measured 0.12 s (1167% off);" \
           " on 2 devices 0.06 s a step, measured 0.76 s (92% off)." in text
    assert "From one profile the fit can only assume the whole step is compute" in text


def test_profiling_says_what_it_runs_and_each_result(tmp_path, capsys):
    """``fsdpx jobs plan`` profiles before it prints anything else (minutes on a CPU): it now
    says on stderr what it will run, then one line per profile as it ends, with its times; the
    report on stdout explains the prediction check in words."""
    from fsdpx.jobs import cli

    log = tmp_path / "log"
    log.mkdir()
    technique = TimedTechnique(log, seconds=0.05)
    technique.strategy = "ddp"  # the bytes it sends, for predictions at the counts not profiled
    (tmp_path / "jobs.toml").write_text("[[job]]\nname = 'a'\nsteps = 10\nbatch_size = 16\nn_layer = 1\n"
                                        "n_embd = 32\nn_head = 2\ncorpus_chars = 4000\n")
    jobs.register("timed", technique)
    try:
        cli.main(["plan", str(tmp_path / "jobs.toml"), "--devices", "2", "--techniques", "timed", "--profiles",
                  str(tmp_path / "p"), "--gantt", str(tmp_path / "plan.png"), "--time-limit", "1"])
        first = capsys.readouterr()
        cli.main(["plan", str(tmp_path / "jobs.toml"), "--devices", "2", "--techniques", "timed", "--profiles",
                  str(tmp_path / "p"), "--gantt", str(tmp_path / "plan.png"), "--time-limit", "1"])
        again = capsys.readouterr()
    finally:
        jobs.techniques.unregister("timed")
    lines = first.err.splitlines()
    assert lines[0].startswith("fsdpx jobs: profiling 2 of 2 (job, technique, device count) with up to 4 real steps")
    ended = sorted(line for line in lines if " a / timed on " in line)
    assert len(ended) == 2 and all(" s a step, " in line and " s to start (in " in line for line in ended)
    assert "a / timed: profiled on 1 and 2 devices" in first.out and "How far to trust it" in first.out
    assert again.err.splitlines()[0].startswith("fsdpx jobs: all 2 profiles from the cache")
    assert sum("(from the cache)" in line for line in again.err.splitlines()) == 2
