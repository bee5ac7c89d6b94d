"""Tensor, pipeline and 3-D parallel techniques in the planner's registry (issue 13): their
search picks degrees the model takes and the memory model fits, and their jobs train as
``fsdpx train --tp/--pp`` does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdpx.jobs as jobs
from fsdpx.jobs import parallel, techniques
from fsdpx.jobs.backends import Attempt, LocalBackend
from fsdpx.jobs.builtin import BUILTIN, FAMILIES, ParallelTechnique, candidates, pipeline_choices
from fsdpx.jobs.gpt_job import gpt_task
from fsdpx.jobs.plan import Option
from fsdpx.jobs.profile import Measurement, ProfileTable
from fsdpx.jobs.runner import run_jobs
from fsdpx.jobs.train_run import run_config
from fsdpx.sharding.tensor_parallel import ColumnParallel, RowParallel, TensorParallel
from fsdpx.train import Layout, run

from support.jobs import run_losses as losses, wait
from support.mlp_job import mlp_task

MiB = 2**20
CORES = sorted(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------- a user's model with blocks


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):  # (B, W)
        return x + self.down(torch.tanh(self.up(x)))


class BlockMLP(nn.Module):
    """A classifier whose hidden layers are a block list (so pipelines cut it) and which names
    its own tensor-parallel plan (Megatron's MLP: up column-, down row-parallel)."""

    def __init__(self, h):
        super().__init__()
        self.inp = nn.Linear(h["d_in"], h["width"])
        self.blocks = nn.ModuleList(Residual(h["width"]) for _ in range(h["depth"]))
        self.out = nn.Linear(h["width"], h["classes"])

    def forward(self, x):  # (B, d_in) -> (B, classes)
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def tensor_parallel_plan(self, tp: int) -> TensorParallel:
        return TensorParallel({"blocks.*.up": ColumnParallel(), "blocks.*.down": RowParallel()})


def block_mlp(h):
    return BlockMLP(h)


def points(h):
    x = torch.randn(h["n"], h["d_in"])
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def cross_entropy(out, y):
    return F.cross_entropy(out, y, reduction="none")


def block_task(name: str = "blocks", *, steps: int = 5, private: bool = False, depth: int = 4) -> jobs.Task:
    return jobs.Task(name, block_mlp, points, cross_entropy, steps=steps, batch_size=32,
                     privacy=jobs.Privacy(target_epsilon=8.0) if private else None,
                     hparams={"d_in": 8, "width": 16, "depth": depth, "classes": 3, "n": 256, "lr": 0.05,
                              "ckpt_every": 2})


def gpt(name: str = "g", **kw) -> jobs.Task:
    return gpt_task(name, steps=kw.pop("steps", 4), batch_size=kw.pop("batch_size", 16), n_layer=kw.pop("n_layer", 4),
                    n_embd=32, n_head=kw.pop("n_head", 4), corpus_chars=20000, **kw)


# ---------------------------------------------------------------------------- the registry, search, memory


def test_the_registry_lists_tensor_pipeline_and_3d_techniques_plain_and_private():
    for family in FAMILIES:
        assert isinstance(techniques.get(family), ParallelTechnique) and not techniques.get(family).private
        assert techniques.get(f"{family}-private").private
    assert {"tp", "pp", "3d", "tp-private", "pp-private", "3d-private"} <= set(techniques.names())


def valid(task: jobs.Task, n: int, d: Layout, family: str) -> None:
    """The degrees are the family's, divide ``n``, and resolve on the model."""
    assert n % (d.tp * d.pp) == 0
    assert (d.tp >= 2) == (family in ("tp", "3d")) and (d.pp >= 2) == (family in ("pp", "3d"))
    assert d.strategy in ("zero2", "zero3")
    if d.pp > 1:
        assert d.pp * d.virtual_stages <= task.hparams.get("n_layer", task.hparams.get("depth"))
        assert d.schedule != "interleaved_1f1b" or d.microbatches % d.pp == 0
    assert parallel.plan_of(task, n, d) is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_search_picks_the_first_layout_that_resolves_and_fits_on_2_4_8_devices(family):
    """On 2, 4 and 8 devices, roomy and tight: ``search``'s degrees are valid for the model
    (heads divide by tp, stages <= blocks), fit the memory, and every layout the search
    prefers to them does not (it resolves nowhere or exceeds the memory); a 3-D layout needs 4
    devices."""
    for task in (gpt(n_head=4), gpt("odd", n_head=2, n_layer=3), block_task()):
        tech = BUILTIN[family]
        for n in (2, 4, 8):
            roomy = jobs.Devices(n, 2**30)
            if family == "3d" and n < 4:
                assert not tech.feasible(task, roomy) and tech.search(task, roomy) == {}
                continue
            fitting = [d for d in candidates(task, family, n) if (parallel.memory(task, n, d) or 2**62) <= 2**30]
            for cap in sorted({parallel.memory(task, n, d) for d in fitting})[:4]:
                devices = jobs.Devices(n, cap)
                chosen = Layout.of(tech.search(task, devices))
                valid(task, n, chosen, family)
                assert parallel.memory(task, n, chosen) <= cap and tech.feasible(task, devices)
                order = candidates(task, family, n)
                assert all((parallel.memory(task, n, d) or 2**62) > cap for d in order[:order.index(chosen)])
            smallest = min(parallel.memory(task, n, d) for d in fitting)
            assert not tech.feasible(task, jobs.Devices(n, smallest - 1))


def test_degrees_follow_the_model():
    """Two heads allow tp = 2 only (on 8 devices: dp 4); one block allows no pipeline; an MLP
    with neither a block list nor a tensor-parallel plan takes neither; a model naming its own
    plan takes tp."""
    roomy = jobs.Devices(8, 2**30)
    assert BUILTIN["tp"].search(gpt(n_head=2), roomy)["tp"] == 2
    assert {d.tp for d in candidates(gpt(n_head=2), "tp", 8) if parallel.plan_of(gpt(n_head=2), 8, d)} == {2}
    assert not BUILTIN["pp"].feasible(gpt(n_layer=1), roomy)
    for family in FAMILIES:
        assert not BUILTIN[family].feasible(mlp_task(), roomy)
    assert BUILTIN["tp"].feasible(block_task(), roomy) and BUILTIN["pp"].feasible(block_task(), roomy)
    assert BUILTIN["pp-private"].feasible(block_task(private=True), roomy)
    assert not BUILTIN["pp-private"].feasible(block_task(), roomy)  # privacy must match


def test_the_memory_model_follows_sharding_and_microbatches_in_flight():
    """GPipe holds every microbatch, 1F1B at most ``p - s`` at stage ``s``: never less; ZeRO-3
    over 4 data-parallel ranks holds less than ZeRO-2; at one data-parallel rank, more
    tensor-parallel ranks hold less (state and column outputs split further)."""
    task = gpt(n_layer=8, batch_size=64)
    mem = lambda n, **kw: parallel.memory(task, n, Layout(**{"strategy": "zero2", **kw}))  # noqa: E731
    for pp in (2, 4, 8):
        assert mem(pp, pp=pp, schedule="gpipe", microbatches=8) > mem(pp, pp=pp, schedule="1f1b", microbatches=8)
    assert mem(8, strategy="zero3", pp=2, microbatches=8) < mem(8, strategy="zero2", pp=2, microbatches=8)
    assert mem(8, strategy="zero3", tp=2) < mem(8, strategy="zero2", tp=2)
    assert mem(4, tp=4) < mem(2, tp=2)


def test_a_private_pipelines_schedules_are_ranked_as_it_runs():
    """A private pipeline forms its ``W``s (clipped sums) in waits or after its list, so
    zero-bubble's deferred ``W``s gain nothing over 1f1b: the search ranks a private task's
    schedules by the private run's time (``simulate_private``), a plain task's by the lists'."""
    units = lambda k, **kw: parallel.step_units(Layout("zero2", pp=4, schedule=k, microbatches=4), **kw)  # noqa: E731
    assert units("zero_bubble") < units("1f1b")
    assert units("zero_bubble", private=True) == units("1f1b", private=True) < units("1f1b")
    assert [c["schedule"] for c in pipeline_choices(block_task(private=True), 4, 1)][:2] == ["interleaved_1f1b", "1f1b"]
    assert pipeline_choices(block_task(), 4, 1)[0]["schedule"] == "zero_bubble"


def test_predictions_of_a_parallel_technique_use_its_degrees_and_traffic_at_each_count():
    """The profile table predicts counts that were not profiled from the technique's own bytes
    sent there, and carries the degrees its search picks there."""
    task, cluster = gpt(), jobs.Devices(8, 2**30)
    tech = BUILTIN["3d"]
    table = ProfileTable()
    params = tuple(sorted(tech.search(task, cluster.group(4)).items()))
    table.add(task.name, "3d", 4, Measurement(0.5, 10 * MiB, True, params, 2.0))
    sent = lambda n: tech.sent_bytes(task, cluster.group(n))  # noqa: E731
    got = table.predict(task, "3d", sent, [4, 8], params_of=lambda n: tech.search(task, cluster.group(n)))
    assert got[4].measured and not got[8].measured
    assert dict(got[8].params) == tech.search(task, cluster.group(8)) and got[8].step_seconds > 0
    assert sent(4) > 0 and sent(8) > 0


# ---------------------------------------------------------------------------- real jobs (torchrun, gloo)


@pytest.mark.slow
def test_a_private_pipeline_job_through_the_runner_ends_with_the_losses_of_its_config_alone(tmp_path):
    """A user's block MLP, private, on ``pp-private`` (2 gloo workers): through the runner its
    losses are those of the same technique and degrees run alone, bit for bit, and those of the
    unsharded single-process run within float32 rounding."""
    task = block_task(private=True)
    cluster = jobs.Devices(2, 2**30)
    params = BUILTIN["pp-private"].search(task, cluster)
    assert params["pp"] == 2
    report = run_jobs([task], {task.name: [Option("pp-private", 2, 10.0, tuple(sorted(params.items())))]}, cluster,
                      tmp_path / "run", stream=None, replan=False)
    assert report.ok, report.jobs[task.name].error
    alone = Attempt(task, "pp-private", cluster.group(2, tuple(CORES[i % len(CORES)] for i in range(2))), params,
                    task.steps, tmp_path / "alone" / "ckpt")
    kind, result = wait(LocalBackend().start(alone))
    assert kind == "ok" and result.ok, result
    got = losses(tmp_path / "run" / task.name / "run")
    assert len(got) == task.steps and got == losses(tmp_path / "alone" / "run")
    run(run_config(task, strategy=None, steps=task.steps, out=tmp_path / "one", ckpt_dir=tmp_path / "one" / "ckpt"),
        progress=False)
    assert got == pytest.approx(losses(tmp_path / "one" / "run"), rel=1e-5)


@pytest.mark.slow
def test_a_tensor_parallel_gpt_job_equals_its_single_process_run(tmp_path):
    """The GPT job on ``tp`` (2 gloo workers: tp 2 over a vocabulary of 69 rows, uneven shards,
    ZeRO-2 over dp 1) through the runner: the single-process run's losses within float32
    rounding."""
    task = gpt("t", n_head=2, n_layer=2, steps=3)
    cluster = jobs.Devices(2, 2**30)
    params = BUILTIN["tp"].search(task, cluster)
    assert (params["tp"], params["strategy"]) == (2, "zero2")
    report = run_jobs([task], {task.name: [Option("tp", 2, 10.0, tuple(sorted(params.items())))]}, cluster,
                      tmp_path / "run", stream=None, replan=False)
    assert report.ok, report.jobs[task.name].error
    run(run_config(task, strategy=None, steps=task.steps, out=tmp_path / "one", ckpt_dir=tmp_path / "one" / "ckpt"),
        progress=False)
    assert losses(tmp_path / "run" / task.name / "run") == pytest.approx(losses(tmp_path / "one" / "run"), rel=1e-5)
