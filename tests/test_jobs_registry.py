"""Jobs as data, the technique registry and the memory model (issue 13, part 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdpx.jobs as jobs
from fsdpx.jobs import techniques
from fsdpx.jobs.builtin import BUILTIN
from fsdpx.jobs.gpt_job import gpt_task
from fsdpx.jobs.task import UnimportableTaskError
from fsdpx.jobs.train_run import run_config
from fsdpx.jobs.memory import job_memory, model_shape

MiB = 2**20


def small(name: str = "a", **kw) -> jobs.Task:
    return gpt_task(name, steps=kw.pop("steps", 10), batch_size=kw.pop("batch_size", 8), n_layer=1, n_embd=32,
                    n_head=2, corpus_chars=4000, **kw)


def test_duplicate_job_names_are_a_named_error():
    with pytest.raises(jobs.DuplicateJobError, match=r"\['a'\]"):
        jobs.task.check_unique_names([small("a"), small("b"), small("a")])


def test_a_job_too_large_for_the_cluster_is_a_named_error():
    big = gpt_task("big", steps=10, batch_size=8, n_layer=8, n_embd=512, n_head=8)
    with pytest.raises(jobs.InfeasibleJobError, match="big"):
        techniques.check_feasible([small("ok"), big], jobs.Devices(4, 16 * MiB))
    # the small one alone plans fine, on several (technique, count) choices
    assert len(techniques.check_feasible([small("ok")], jobs.Devices(4, 16 * MiB))["ok"]) > 4


def test_a_private_job_only_gets_private_techniques():
    choices = techniques.check_feasible([small("p", privacy=jobs.Privacy())], jobs.Devices(2, 2**30))["p"]
    assert choices and all(t.endswith("-private") for t, _ in choices)
    # one block cannot be cut into pipeline stages; a 3-D layout needs 4 devices
    assert {t for t, _ in choices} == {n for n in BUILTIN if n.endswith("-private")} - {"pp-private", "3d-private"}


def test_memory_model_shrinks_with_devices():
    task = small(batch_size=64)
    for strategy in ("zero2", "zero3"):
        mem = [job_memory(task, strategy, n) for n in (1, 2, 4, 8)]
        assert mem == sorted(mem, reverse=True) and mem[-1] < mem[0]
    assert job_memory(task, "zero3", 4, optimizer_fraction=0.1) < job_memory(task, "zero3", 4)
    shape = model_shape(task)
    assert shape.num_params == sum(p.numel() for p in jobs.gpt_job.gpt_model(task.hparams).parameters())


def test_zenflow_search_picks_the_largest_fraction_that_fits():
    task, tech = small(batch_size=64), BUILTIN["zero3+zenflow"]
    roomy = jobs.Devices(2, 2**30)
    assert tech.search(task, roomy) == {"offload_topk": 0.5}
    tight = jobs.Devices(2, job_memory(task, "zero3", 2, optimizer_fraction=0.1))
    assert tech.search(task, tight) == {"offload_topk": 0.1}


# A user's technique, in a few lines: a plain SGD loop in this process on one device, for any model.
class OneDeviceSGD:
    def feasible(self, task, devices):
        return devices.count == 1

    def search(self, task, devices):
        return {"lr": 0.1}

    def execute(self, task, devices, params, steps, ckpt_dir):
        model, (x, y) = task.model_fn(task.hparams), task.data_fn(task.hparams)
        opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
        for _ in range(steps):
            opt.zero_grad()
            loss = task.loss_fn(model(x), y).mean()
            loss.backward()
            opt.step()
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        return loss.item()


def regression_task(name: str) -> jobs.Task:
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    return jobs.Task(name, lambda h: nn.Linear(3, 1, bias=False), lambda h: (x, y),
                     lambda out, t: (out.squeeze(-1) - t) ** 2, steps=50, batch_size=64)


def test_a_user_registers_a_toy_technique(tmp_path):
    jobs.register("toy-sgd", OneDeviceSGD())
    try:
        with pytest.raises(ValueError, match="already registered"):
            jobs.register("toy-sgd", OneDeviceSGD())
        task = regression_task("reg")
        choices = techniques.check_feasible([task], jobs.Devices(4, 2**30), ["toy-sgd"])
        assert choices == {"reg": [("toy-sgd", 1)]}
        tech = techniques.get("toy-sgd")
        assert tech.execute(task, jobs.Devices(1, 2**30), tech.search(task, None), 50, tmp_path / "ck") < 1e-3
    finally:
        techniques.unregister("toy-sgd")
    with pytest.raises(techniques.UnknownTechniqueError, match="toy-sgd"):
        techniques.get("toy-sgd")
    with pytest.raises(TypeError, match="feasible, search and execute"):
        jobs.register("broken", object())


def test_builtin_techniques_refuse_a_job_whose_functions_workers_cannot_import(tmp_path):
    with pytest.raises(UnimportableTaskError, match="job 'reg': model_fn .*lambda"):
        run_config(regression_task("reg"), strategy="ddp", steps=1, out=tmp_path, ckpt_dir=tmp_path / "c")


def test_a_private_job_keeps_its_full_run_noise_when_stopped_early(tmp_path):
    task = small("p", steps=100, privacy=jobs.Privacy(target_epsilon=2.0))
    early = run_config(task, strategy="zero2", steps=3, out=tmp_path, ckpt_dir=tmp_path / "c").flat()
    full = run_config(task, strategy="ddp", steps=100, out=tmp_path, ckpt_dir=tmp_path / "c").flat()
    assert early["noise_multiplier"] == full["noise_multiplier"] > 0 and early["steps"] == 3 and early["resume_if_present"]


@pytest.mark.slow
def test_a_job_moved_by_checkpoint_to_fewer_devices_continues_its_steps(tmp_path):
    """execute on 2 processes (zero2, private) to step 3, then on 1 process to step 5: the run
    resumes from the checkpoint and its metrics hold steps 1..5 exactly once."""
    task = small("m", steps=5, privacy=jobs.Privacy(target_epsilon=4.0))
    tech = techniques.get("zero2-private")
    first = tech.execute(task, jobs.Devices(2, 2**30), {}, 3, tmp_path / "m" / "ckpt")
    assert first.ok, first.error
    assert first.summary["steps"] == 3 and len(first.peak_bytes) == 2
    second = tech.execute(task, jobs.Devices(1, 2**30), {}, 5, tmp_path / "m" / "ckpt")
    assert second.ok, second.error
    rows = [json.loads(r) for r in (tmp_path / "m" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert 0 < second.summary["epsilon"] <= 4.0 + 1e-9
