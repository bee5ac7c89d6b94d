"""What a private pipeline stage keeps between a microbatch's backward and its clipped sums:
``privacy.contributions.kept_bytes`` counts it, ``fsdpx.jobs.memory.contribution_bytes``
predicts it on the meta device, and the planner's memory model holds it over the private
policy's timeline (``fsdpx.jobs.parallel.activation_bytes``)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import fsdpx.jobs as jobs
from fsdpx.jobs import parallel
from fsdpx.jobs.gpt_job import corpus_data, gpt_task
from fsdpx.jobs.memory import contribution_bytes
from fsdpx.train.layout import Layout
from fsdpx.sharding.layout import local_shape
from privacy import contributions as C
from privacy.contributions import Dense, Factored, kept_bytes
from privacy.step import DPConfig

from support import tp_hf
from support.mesh_runs import pipelined_run
from support.reference import optimizer_for

HP = dict(n_layer=4, n_head=2, n_embd=16, block_size=8, corpus_chars=4000)
PLAIN = gpt_task("contrib-plain", steps=1, batch_size=8, **HP)


def test_kept_bytes_counts_each_distinct_tensor_once():
    left, right = torch.zeros(2, 3, 5), torch.zeros(2, 3, 7)
    dense = torch.zeros(2, 5, dtype=torch.float64)
    parts = {"w": [Factored(left, right, 5, (0, 5))], "v": [Factored(left, right[:, :2], 5, (0, 5))],
             "b": [Dense(dense)]}
    assert kept_bytes(parts) == (30 + 42) * 4 + 10 * 8
    assert kept_bytes({}) == 0 and C.factor_bytes(parts) == (30 + 42) * 4


def _private_task(batch_size: int):
    return gpt_task("contrib", steps=1, batch_size=batch_size, privacy=jobs.Privacy(target_epsilon=8.0), **HP)


@pytest.mark.parametrize("schedule, pp, m, tp", [("1f1b", 2, 2, 1), ("interleaved_1f1b", 2, 4, 1), ("1f1b", 2, 2, 2)])
def test_predicted_contribution_bytes_are_what_the_runtime_keeps(monkeypatch, schedule, pp, m, tp):
    """The private pipeline's runtime on the simulated mesh, with the real ``instantiate_for_reuse``
    watched: every microbatch of every stage keeps exactly the bytes the meta-device prediction
    gives that stage; with tensor parallelism (a vocabulary of 69 rows, split 35 / 34) the
    prediction is the largest rank's, which some rank keeps exactly and none exceeds."""
    task = _private_task(8)
    degrees = Layout(strategy="ddp", tp=tp, pp=pp, schedule=schedule, microbatches=m,
                               virtual_stages=2 if schedule == "interleaved_1f1b" else 1)
    meta, plan, mesh = parallel.plan_of(task, pp * tp, degrees)
    stage_of = parallel.stage_of_modules(meta, plan)
    blocks = tuple((n, L.param_shape(local_shape(L.shape, L.compute, mesh, 0))) for n, L in plan.params.items())
    canonical, held = {id(p): n for n, p in meta.named_parameters()}, defaultdict(set)
    for mod, s in stage_of.items():  # the stages whose modules call each parameter (tied: two)
        for _, p in dict(meta.named_modules())[mod].named_parameters(recurse=False):
            held[canonical[id(p)]].add(s)
    micro = 8 // m
    want = contribution_bytes(task, micro, tuple(stage_of.items()), plan.pipeline.num_stages, blocks if tp > 1 else ())

    kept: list[tuple[set[int], int]] = []
    real = C.instantiate_for_reuse

    def watched(parts, shapes, **kw):
        out = real(parts, shapes, **kw)
        kept.append((set().union(*(held[n] for n in out if len(held[n]) == 1)), kept_bytes(out)))
        return out

    monkeypatch.setattr(C, "instantiate_for_reuse", watched)
    torch.manual_seed(0)
    model = task.model_fn(task.hparams)
    inputs, targets = corpus_data(task.hparams)
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, method="auto")
    pipelined_run(model, [(inputs[:8], targets[:8])], optimizer_for(torch.float32), plan, mesh, config)
    assert len(kept) == m * plan.pipeline.num_stages * tp
    by_stage = defaultdict(list)
    for stages, got in kept:
        (s,) = stages
        by_stage[s].append(got)
    for s, got in by_stage.items():
        assert max(got) == want[s] > 0 and (tp > 1 or min(got) == want[s])
    if tp > 1:  # the blocks are smaller than the whole
        whole = contribution_bytes(task, micro, tuple(stage_of.items()), plan.pipeline.num_stages)
        assert all(w < full for w, full in zip(want, whole))


def test_a_private_1f1b_rank_holds_every_microbatchs_contributions():
    """Equal costs: the last rank of a private 1f1b forms no ``W`` before its list ends, so at
    its last ``B`` it holds all ``m`` microbatches' contributions (and at most one microbatch's
    activations beside them); more microbatches do not shrink it, where a plain pipeline's
    last rank holds one microbatch's activations."""
    task = _private_task(8)
    for m in (2, 4):
        degrees = Layout(strategy="ddp", pp=2, schedule="1f1b", microbatches=m)
        resolved = parallel.plan_of(task, 2, degrees)
        stage_of = parallel.stage_of_modules(resolved.model, resolved.plan)
        con = contribution_bytes(task, 8 // m, tuple(stage_of.items()), 2)
        held = parallel.activation_bytes(task, resolved)
        plain = parallel.activation_bytes(PLAIN, parallel.plan_of(PLAIN, 2, degrees))
        assert m * con[1] <= held[1] <= m * con[1] + plain[1]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_models_keep_what_is_predicted_under_tensor_parallelism(monkeypatch, family):
    """transformers' GPT-2 (tied, fused ``c_attn`` as ``Conv1D``) and Llama (q, k, v sharing one
    input), unmodified, private on tp = 2 x pp = 2: the largest rank keeps per stage exactly
    what ``contribution_bytes_of`` predicts from the model and the plan's blocks."""
    pytest.importorskip("transformers")
    from fsdpx.jobs.memory import contribution_bytes_of
    from fsdpx.models.tp_plans import gpt2_plan, llama_plan
    from fsdpx.sharding import Mesh, strategies
    from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
    from fsdpx.sharding.tensor_parallel import resolve

    model, tp_plan = (tp_hf.gpt2("eager"), gpt2_plan) if family == "gpt2" else (tp_hf.llama("eager"), llama_plan)
    mesh = Mesh(dp=1, tp=2, pp=2)
    plan = resolve_pipeline(model, resolve(model, tp_plan(model.config), strategies.zero3(), mesh),
                            PipelineParallel(schedule="1f1b", microbatches=2), mesh)
    stage_of = parallel.stage_of_modules(model, plan)
    blocks = {n: L.param_shape(local_shape(L.shape, L.compute, mesh, 0)) for n, L in plan.params.items()}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, tp_hf.VOCAB, (4, 8), generator=g), torch.randint(0, tp_hf.VOCAB, (4, 8), generator=g))
    want = contribution_bytes_of(model, tp_hf.hf_loss, (batch[0][:2], batch[1][:2]), stage_of, 2, blocks)

    kept: dict[int, list[int]] = defaultdict(list)
    real = C.instantiate_for_reuse

    def watched(parts, shapes, **kw):
        out = real(parts, shapes, **kw)  # a stage's parts: its own modules' (and a tied first-stage weight)
        kept[max(stage_of[n.rsplit(".", 1)[0]] for n in out)].append(kept_bytes(out))
        return out

    monkeypatch.setattr(C, "instantiate_for_reuse", watched)
    config = DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="auto")
    pipelined_run(model, [batch], optimizer_for(torch.float64), plan, mesh, config, loss_fn=tp_hf.hf_loss)
    assert sorted(kept) == [0, 1] and all(len(got) == 2 * 2 for got in kept.values())  # microbatches x tp ranks
    for s, got in kept.items():
        assert max(got) == want[s]
