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

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.models.gpt import token_loss
from fsdpx.runtime.activation_cost import pipeline_activation_collectives
from fsdpx.sharding.pipeline import pipeline_comm_per_step

from support.mesh_runs import pipelined_run
from support.pipeline_cases import pipelines
from support.reference import assert_close_to_reference, baseline, dp_config, optimizer_for

@settings(max_examples=40)
@given(pipelines(), st.booleans())
def test_pipelined_steps_equal_unsharded_steps(case, private):
    model, batches, plan, mesh = case
    optimizer = optimizer_for(torch.float64)
    config = dp_config(private)
    ref = baseline(model, batches, optimizer, config)
    got, metrics = pipelined_run(model, batches, optimizer, plan, mesh, config)
    assert_close_to_reference(got, ref, model, 1e-10)
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
    _, metrics = pipelined_run(model, batches[:1], optimizer_for(torch.float64), plan, mesh, dp_config(private))
    x, y = batches[0]
    hidden = (x.shape[1], model.config.n_embd)
    activations = pipeline_activation_collectives(model, plan, mesh, token_loss, tuple(x.shape), tuple(y.shape),
                                                  hidden, dtype=torch.float64)
    want = pipeline_comm_per_step(plan, mesh, 0, batch_size=x.shape[0], hidden=hidden, dtype=torch.float64,
                                  private=private, activations=activations)
    assert _nonzero(metrics[0]["comm_bytes"]) == _nonzero(want)
