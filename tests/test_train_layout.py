"""The run's parallel layout (issue 27): one value, its mesh derived in one place, its plan
resolved once per run and handed down."""

from __future__ import annotations

import pytest
import torch

import fsdpx.train.parallel as parallel
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding.mesh import Mesh
from fsdpx.train import ConfigError, Layout, RunConfig, run

TINY = dict(n_layer=2, n_embd=16, n_head=2, block_size=8, corpus_chars=3000, batch_size=16.0, noise_multiplier=1.0,
            target_epsilon=None)


@pytest.mark.parametrize("layout, world, mesh", [
    (Layout("zero3"), 4, Mesh(dp=4)),
    (Layout("hsdp"), 4, Mesh(replica=2, shard=2)),
    (Layout("hsdp"), 3, Mesh(replica=1, shard=3)),
    (Layout("zero2", tp=2), 4, Mesh(dp=2, tp=2)),
    (Layout("ddp", pp=2), 4, Mesh(pp=2, dp=2)),
    (Layout("zero3", tp=2, pp=2), 8, Mesh(pp=2, dp=2, tp=2)),
    (Layout("hsdp", tp=2, pp=2), 16, Mesh(pp=2, replica=2, shard=2, tp=2)),
])
def test_the_mesh_puts_pp_first_tp_last_and_hsdp_in_shards_of_two(layout, world, mesh):
    got = layout.mesh(world)
    assert got == mesh and got.axis_names == mesh.axis_names  # the order of the axes too


def test_degrees_that_cannot_work_are_refused_by_name():
    with pytest.raises(ConfigError, match="tp=2 x pp=2 does not divide the 6 processes"):
        Layout("zero3", tp=2, pp=2).mesh(6)
    with pytest.raises(ConfigError, match="tp needs a strategy"):
        Layout(tp=2)
    with pytest.raises(ConfigError, match="unknown strategy 'zero4'"):
        RunConfig.of(strategy="zero4")


def test_the_config_holds_the_layout_the_jobs_planner_takes():
    config = RunConfig.of(strategy="zero3", tp=2, pp=2, microbatches=8, n_layer=4)
    assert config.parallelism == Layout("zero3", tp=2, pp=2, microbatches=8)
    assert Layout.of(config.parallelism.params()) == config.parallelism


@pytest.mark.parametrize("extra", [dict(strategy="zero3"), dict(strategy="ddp", pp=2, microbatches=2)],
                         ids=["zero3", "pp2"])
def test_a_run_resolves_its_plan_once(tmp_path, monkeypatch, extra):
    """Every rank of a sharded run resolves the layout on its model exactly once; the step, the
    checkpoint manager and the gathering of the trained parameters receive that result."""
    calls = []
    resolve_plan = parallel.resolve_plan

    def counted(*args, **kwargs):
        calls.append(1)
        return resolve_plan(*args, **kwargs)

    monkeypatch.setattr(parallel, "resolve_plan", counted)
    torch.set_num_threads(1)
    config = RunConfig.of(steps=2, out=str(tmp_path), name="once", **TINY, **extra)
    mesh = config.parallelism.mesh(2)
    summaries = run_threads(mesh, lambda comm: run(config, progress=False, comm=comm), timeout=300)
    assert len(calls) == mesh.size
    assert summaries[0]["steps"] == 2 and summaries[0]["sample"] == summaries[1]["sample"]
    run(config.replace(strategy=None, pp=1, name="alone"), progress=False)
    assert len(calls) == mesh.size  # one process: no plan at all
