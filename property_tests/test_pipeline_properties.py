"""Pipeline parallelism (every schedule, composed with data and tensor parallelism) equals
unsharded training.

The invariant: for every schedule kind, pp in 1..4 (virtual stages 1..2 where interleaved),
tp in 1..2 and dp in 1..2 on the simulated mesh, random small GPTs (tied or untied head, 2..4
blocks, uneven splits, empty and tiny batches so some microbatches are empty), N pipelined steps
equal N unsharded steps, plain and private (ghost clipping, same key), float64 to rel 1e-10,
judged as ``test_sharded_properties`` judges them; every rank reports the same loss; the tied
embedding and head stay bit-identical on the first and last stage (``unshard_stages`` checks).
Private: each stage's share of every example's squared norm, the tied parameter's norm completed
on the last stage from both stages' contributions (cross term included), one all-reduce over
the pipeline and tensor ranks, then each stage's clipped sums.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sharded_properties import _assert_close_to_reference, _baseline, _dp_config, _optimizer

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.activation_cost import pipeline_activation_collectives
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding import Mesh, strategies
from fsdpx.sharding.pipeline import PipelineParallel, pipeline_comm_per_step, resolve_pipeline, unshard_stages
from fsdpx.sharding.schedule import KINDS
from fsdpx.sharding.tensor_parallel import resolve

MESHES = [  # (strategy, mesh)
    ("ddp", Mesh(dp=1, pp=2)), ("ddp", Mesh(dp=1, pp=3)), ("ddp", Mesh(dp=1, pp=4)), ("ddp", Mesh(dp=1, pp=1)),
    ("zero3", Mesh(dp=2, pp=2)), ("zero2", Mesh(dp=2, pp=2)), ("ddp", Mesh(dp=2, pp=2)),
    ("zero3", Mesh(dp=1, tp=2, pp=2)), ("zero3", Mesh(dp=2, tp=2, pp=2)), ("hsdp", Mesh(replica=1, shard=2, pp=2)),
]


@st.composite
def pipelines(draw):
    strategy, mesh = draw(st.sampled_from(MESHES))
    p = mesh.axis_size("pp")
    tp = mesh.axis_size("tp") if "tp" in mesh.axis_names else 1
    kind = draw(st.sampled_from(KINDS))
    v = draw(st.integers(1, 2)) if kind == "interleaved_1f1b" else 1
    m = p * draw(st.integers(1, 2)) if kind == "interleaved_1f1b" else draw(st.integers(1, 5))
    heads = tp * draw(st.integers(1, 2))
    vocab = draw(st.integers(5, 13).filter(lambda n: tp == 1 or -(-n // tp) * (tp - 1) < n))
    config = GPTConfig(vocab_size=vocab, block_size=draw(st.integers(2, 4)),
                       n_layer=draw(st.integers(p * v, p * v + 2)), n_head=heads, n_embd=heads * draw(st.integers(1, 2)),
                       bias=draw(st.booleans()), tie_weights=draw(st.booleans()))
    torch.manual_seed(draw(st.integers(0, 2**31)))
    model = GPT(config).double()
    B = draw(st.integers(0, 6))
    batches = [(torch.randint(0, vocab, (B, config.block_size)), torch.randint(0, vocab, (B, config.block_size)))
               for _ in range(2)]
    base = resolve(model, gpt_plan(config) if tp > 1 else None, strategies.ALL[strategy](), mesh)
    plan = resolve_pipeline(model, base, PipelineParallel(schedule=kind, microbatches=m, virtual_stages=v), mesh)
    return model, batches, plan, mesh


def _pipelined(model, batches, optimizer, plan, mesh, config=None, *, loss_fn=None):
    """Every rank's steps on the simulated mesh (each with its own copy of ``model``); returns
    the trained parameters of the plan, unsharded in their own shapes, and every rank's last
    metrics. Parameters outside the plan stay frozen."""
    params = {k: v.detach() for k, v in model.named_parameters() if k in plan.params}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        m = copy.deepcopy(model)
        step = make_sharded_step(m, loss_fn or token_loss, optimizer, plan, comm, param_shapes=shapes, config=config,
                                 num_examples=50)
        state = init_sharded(params, optimizer, plan, comm, key=7, config=config)
        for b in batches:
            state, metrics = step(state, b)
        return state, metrics

    results = run_threads(mesh, rank, timeout=60)
    full = unshard_stages([r[0].params for r in results], plan, mesh)
    return {k: t.reshape(shapes[k]) for k, t in full.items()}, [r[1] for r in results]


@settings(max_examples=40)
@given(pipelines(), st.booleans())
def test_pipelined_steps_equal_unsharded_steps(case, private):
    model, batches, plan, mesh = case
    optimizer = _optimizer(torch.float64)
    config = _dp_config(private)
    ref = _baseline(model, batches, optimizer, config)
    got, metrics = _pipelined(model, batches, optimizer, plan, mesh, config)
    _assert_close_to_reference(got, ref, model, 1e-10)
    assert len({m["loss"] for m in metrics if m["batch_size"]}) <= 1
    assert {m["batch_size"] for m in metrics} == {batches[-1][1].shape[0]}


def _nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v}


@settings(max_examples=25)
@given(pipelines(), st.booleans())
def test_counted_bytes_equal_pipeline_comm_per_step(case, private):
    """Rank 0 counts exactly ``pipeline_comm_per_step`` (parameter collectives per microbatch,
    reductions and updates once, activations and shared gradients point to point; private: the
    norms' all-reduce over the pipeline and tensor ranks and the tied parameter's contributions
    sent to its last holder), with tensor parallelism's activation collectives traced stage by
    stage (``pipeline_activation_collectives``)."""
    model, batches, plan, mesh = case
    _, metrics = _pipelined(model, batches[:1], _optimizer(torch.float64), plan, mesh, _dp_config(private))
    x, y = batches[0]
    hidden = (x.shape[1], model.config.n_embd)
    activations = pipeline_activation_collectives(model, plan, mesh, token_loss, tuple(x.shape), tuple(y.shape),
                                                  hidden, dtype=torch.float64)
    want = pipeline_comm_per_step(plan, mesh, 0, batch_size=x.shape[0], hidden=hidden, dtype=torch.float64,
                                  private=private, activations=activations)
    assert _nonzero(metrics[0]["comm"]) == _nonzero(want)
