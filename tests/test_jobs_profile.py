"""Profiles: measured steps, the disk cache and predictions for unprofiled counts (issue 13)."""

from __future__ import annotations

import pytest

import fsdpx.jobs as jobs
from fsdpx.jobs.builtin import BUILTIN
from fsdpx.jobs.gpt_job import gpt_task
from fsdpx.jobs.profile import Measurement, ProfileTable, StepModel, fit_step_model, sent_bytes
from fsdpx.jobs.profile_store import cache_key, profile
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
