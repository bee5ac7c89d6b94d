"""A user's own job on the built-in techniques (issue 13): ``Task(name, model_fn, data_fn,
loss_fn, ...)`` whose functions are module-level, run by ``fsdpx train``'s loop in torchrun
workers that import them by name (``fsdpx.jobs.train_run``, ``model = "python"``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import fsdpx.jobs as jobs
from fsdpx.jobs import techniques
from fsdpx.jobs.backends import Attempt, LocalBackend
from fsdpx.jobs.builtin import BUILTIN
from fsdpx.jobs.live import checkpoint_step, read_progress
from fsdpx.jobs.plan import Option
from fsdpx.jobs.profile import ProfileTable
from fsdpx.jobs.profile_store import profile
from fsdpx.jobs.runner import run_jobs
from fsdpx.jobs.task import UnimportableTaskError
from fsdpx.jobs.train_run import run_config
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.train import data, run

from support.jobs import run_losses as losses, wait
from support.mlp_job import blobs, cross_entropy, mlp, mlp_task

CORES = sorted(os.sched_getaffinity(0))


# ------------------------------------------------ the user's functions (the MLP job's: support.mlp_job)


def tiny_gpt(h):
    return GPT(GPTConfig(vocab_size=data.VOCAB_SIZE, block_size=h["block"], n_layer=1, n_head=2, n_embd=h["width"]))


def corpus_windows(h):
    return data.make_examples(data.corpus(h["chars"]), h["block"])


def gpt_user_task(name: str, steps: int) -> jobs.Task:
    return jobs.Task(name, tiny_gpt, corpus_windows, token_loss, steps=steps, batch_size=16,
                     privacy=jobs.Privacy(target_epsilon=8.0),
                     hparams={"block": 16, "width": 32, "chars": 20000, "ckpt_every": 5})


def alone(task: jobs.Task, root: Path) -> list[float]:
    """The job trained in this process, unsharded, by the loop the workers run."""
    run(run_config(task, strategy=None, steps=task.steps, out=root, ckpt_dir=root / "ckpt"), progress=False)
    return losses(root / "run")


# ---------------------------------------------------------------------------- before anything runs


def test_a_lambda_is_refused_by_name_before_anything_starts(tmp_path):
    """A lambda, a function defined inside another and one of ``__main__`` cannot be imported
    by a torchrun worker: each is an ``UnimportableTaskError`` naming the job, the function and
    the fix, from ``check_feasible`` and from the runner, before any file or process exists."""
    def inner(h):
        return mlp(h)

    main = lambda out, y: cross_entropy(out, y)  # noqa: E731
    main.__module__, main.__qualname__ = "__main__", "loss"
    cases = {"lam": (lambda h: mlp(h), blobs, cross_entropy, "model_fn .*is a lambda"),
             "loc": (mlp, inner, cross_entropy, "data_fn .*is defined inside test_a_lambda"),
             "main": (mlp, blobs, main, "loss_fn loss is defined in the script run as __main__")}
    cluster = jobs.Devices(2, 2**30)
    for name, (m, d, l, what) in cases.items():
        task = jobs.Task(name, m, d, l, steps=3, batch_size=8, hparams={"d_in": 8, "hidden": 4, "classes": 3, "n": 32})
        with pytest.raises(UnimportableTaskError, match=f"job '{name}': {what}.*define it with `def` at the top"):
            techniques.check_feasible([task], cluster)
        with pytest.raises(UnimportableTaskError, match=f"job '{name}'"):
            run_jobs([task], {name: [Option("ddp", 1, 1.0)]}, cluster, tmp_path / "run", stream=None)
        with pytest.raises(UnimportableTaskError, match=f"job '{name}'"):
            profile(task, "zero3", cluster, root=tmp_path / "profiles")
        assert not BUILTIN["ddp"].feasible(task, cluster)
    assert not any(tmp_path.iterdir())
    bad = mlp_task("json", when=object())
    with pytest.raises(UnimportableTaskError, match="job 'json': hparams must be JSON"):
        techniques.check_feasible([bad], cluster)


def test_a_user_task_plans_on_every_builtin_of_its_privacy():
    plain, private = mlp_task("a"), mlp_task("p", private=True)
    got = techniques.check_feasible([plain, private], jobs.Devices(2, 2**30))
    data_parallel = {n for n, t in BUILTIN.items() if hasattr(t, "strategy")}  # an MLP has no tp plan, no blocks
    assert {t for t, _ in got["a"]} == {n for n in data_parallel if not n.endswith("-private")}
    assert {t for t, _ in got["p"]} == {n for n in data_parallel if n.endswith("-private")}


def test_a_user_task_becomes_a_python_run_of_its_functions(tmp_path):
    """The run names the functions by reference, passes the hparams, takes lr and ckpt_every
    from them, and a private job's noise is the one calibrated for its full steps."""
    task = mlp_task("p", steps=40, private=True)
    early = run_config(task, strategy="zero3", steps=3, out=tmp_path, ckpt_dir=tmp_path / "c").flat()
    full = run_config(task, strategy="ddp", steps=40, out=tmp_path, ckpt_dir=tmp_path / "c").flat()
    assert (early["model"], early["model_fn"], early["data_fn"], early["loss_fn"]) == (
        "python", f"{mlp.__module__}:mlp", f"{mlp.__module__}:blobs", f"{mlp.__module__}:cross_entropy")
    assert early["hparams"] == task.hparams and early["lr"] == 0.05 and early["ckpt_every"] == 4
    assert early["noise_multiplier"] == full["noise_multiplier"] > 0 and early["steps"] == 3 and early["resume_if_present"]
    plain = run_config(mlp_task("a"), strategy="ddp", steps=2, out=tmp_path, ckpt_dir=tmp_path / "c")
    assert plain.privacy.private is False


def test_the_single_process_run_trains_checkpoints_and_logs_what_the_live_table_reads(tmp_path):
    task = mlp_task("a", steps=10)
    got = alone(task, tmp_path)
    assert len(got) == 10 and got[-1] < got[0]
    p = read_progress(tmp_path)
    assert p.step == 10 and p.loss == got[-1] and p.seconds > 0
    assert checkpoint_step(tmp_path) == 10  # every 4 steps and at the end: 4, 8, 10


# ---------------------------------------------------------------------------- real runs (torchrun, gloo)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("alone")
    return {private: alone(mlp_task(private=private), root / str(private)) for private in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["ddp", "zero3", "ddp-private", "zero3-private"])
def test_a_user_task_on_two_workers_equals_the_single_process_run(technique, references, tmp_path):
    """Through the runner on 2 gloo workers: the same Poisson batches and noise as one process,
    so the same losses at every step (float32, rel 1e-5); the live table's progress is its last."""
    private = technique.endswith("-private")
    task = mlp_task(private=private)
    report = run_jobs([task], {task.name: [Option(technique, 2, 10.0)]}, jobs.Devices(2, 2**30), tmp_path,
                      stream=None, replan=False)
    assert report.ok, report.jobs[task.name].error
    got = losses(tmp_path / task.name / "run")
    assert len(got) == task.steps and got == pytest.approx(references[private], rel=1e-5)
    assert read_progress(tmp_path / task.name).step == task.steps
    summary = report.jobs[task.name].result.summary
    assert (0 < summary["epsilon"] <= 8.0 + 1e-9) if private else summary["epsilon"] is None


def attempt(task, technique: str, n: int, root: Path) -> Attempt:
    return Attempt(task, technique, jobs.Devices(n, 2**30, ids=tuple(CORES[i % len(CORES)] for i in range(n))),
                   {}, task.steps, root / task.name / "ckpt")


@pytest.mark.slow
def test_a_stopped_user_task_resumes_bit_for_bit(tmp_path):
    """A private GPT of the user's functions on zero3 (2 workers), its processes killed mid-run
    as a move does, restarted from its newest checkpoint with the same technique and count:
    the unmoved run's losses bit for bit, and its epsilon."""
    task = gpt_user_task("g", 16)
    backend = LocalBackend()
    unmoved, ref = backend.start(attempt(task, "zero3-private", 2, tmp_path / "ref")), None  # side by side
    try:
        root = tmp_path / "moved"
        handle = backend.start(attempt(task, "zero3-private", 2, root))
        while read_progress(root / "g").step < 7:
            assert handle.poll() is None, "the first attempt ended before it could be moved"
            time.sleep(0.05)
        handle.stop()
        at = checkpoint_step(root / "g")
        assert 5 <= at < 16
        kind, result = wait(backend.start(attempt(task, "zero3-private", 2, root)))
        assert kind == "ok" and result.ok, result
        kind, ref = wait(unmoved)
        assert kind == "ok" and ref.ok, ref
    finally:
        if ref is None:  # the test failed before the unmoved run was waited for: nothing left running
            unmoved.stop()
    assert result.summary["start_step"] == at
    assert losses(root / "g" / "run") == losses(tmp_path / "ref" / "g" / "run")
    assert result.summary["epsilon"] == ref.summary["epsilon"]


@pytest.mark.slow
def test_a_user_task_is_profiled_and_predicted(tmp_path):
    """``profile`` runs real steps of the user's job once (then reads the cache), and the
    profile table predicts its other counts from the cost model."""
    task = mlp_task("prof", steps=20)
    m = profile(task, "zero2", jobs.Devices(2, 2**30), root=tmp_path, steps=3)
    assert m.measured and m.step_seconds > 0 and m.peak_bytes > 0
    assert profile(task, "zero2", jobs.Devices(2, 2**30), root=tmp_path, steps=3) == m
    assert len(list(tmp_path.glob("*.json"))) == 1
    table = ProfileTable()
    table.add(task.name, "zero2", 2, m)
    predicted = table.predict(task, "zero2", "zero2", [1, 2, 4])
    assert predicted[2] == m and all(p.step_seconds > 0 and not p.measured for n, p in predicted.items() if n != 2)
    options = table.options([task])[task.name]
    assert sorted(o.devices for o in options) == [1, 2, 4]


def test_a_python_run_is_checked_and_its_file_reads_back(tmp_path):
    """``fsdpx train``'s ``model = "python"``: the three references are required and well formed,
    the data is data_fn's, and the resolved config file reads back as the same run."""
    from fsdpx.train.config import ConfigError, RunConfig, read_file, to_toml

    refs = {"model_fn": f"{mlp.__module__}:mlp", "data_fn": f"{mlp.__module__}:blobs",
            "loss_fn": f"{mlp.__module__}:cross_entropy"}
    config = RunConfig.of(model="python", **refs, hparams={"d_in": 8, "hidden": 4, "classes": 3, "n": 32})
    (tmp_path / "run.toml").write_text(to_toml(config))
    assert RunConfig.of(**read_file(tmp_path / "run.toml")) == config
    for bad, message in [({**refs, "loss_fn": None}, "missing loss_fn"), ({**refs, "data_fn": "blobs"}, "module:qualname"),
                         ({**refs, "data_path": "x.npy"}, "drop data_path")]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.of(model="python", **bad)
    with pytest.raises(ConfigError, match='add model = "python"'):
        RunConfig.of(model_fn=refs["model_fn"])
