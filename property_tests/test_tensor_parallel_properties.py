"""Tensor parallelism (composed with every data-parallel strategy) equals unsharded training.

The invariant: for tp in 1..4 and dp in 1..2 (and HSDP x TP on three axes) on the simulated
mesh, with and without sequence parallelism, random small GPTs (uneven vocabularies, several heads per rank or one, tied or untied
LM head, with or without biases, LayerNorm or RMSNorm, empty and tiny batches), N sharded steps
equal N unsharded steps, plain and private (same key), float64 to rel 1e-10 and float32 to
1e-5, judged as ``test_sharded_properties`` judges them.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.optim import sgd
from fsdpx.runtime.activation_cost import activation_collectives
from fsdpx.runtime.units import make_units
from fsdpx.sharding import Mesh, comm_per_step, memory_by_rank, strategies
from fsdpx.sharding.tensor_parallel import resolve

from support.mesh_runs import tensor_parallel_run
from support.reference import assert_close_to_reference, baseline, dp_config, optimizer_for

MESHES = [  # (strategy, mesh): tp 1..4 over dp 1..2, the other strategies, HSDP x TP
    ("zero3", Mesh(dp=1, tp=2)), ("zero3", Mesh(dp=2, tp=2)), ("zero3", Mesh(dp=1, tp=3)),
    ("zero3", Mesh(dp=1, tp=4)), ("zero3", Mesh(dp=2, tp=1)), ("zero3", Mesh(dp=2, tp=3)),
    ("ddp", Mesh(dp=2, tp=2)), ("zero1", Mesh(dp=2, tp=2)), ("zero2", Mesh(dp=2, tp=2)),
    ("hsdp", Mesh(replica=1, shard=2, tp=2)), ("hsdp", Mesh(replica=2, shard=1, tp=2)),
]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@st.composite
def problems(draw, tp: int):
    heads = tp * draw(st.integers(1, 2))  # whole heads per rank: a head is never split
    # uneven vocabularies; every rank keeps at least one row (``resolve`` refuses otherwise)
    vocab = draw(st.integers(5, 13).filter(lambda v: tp == 1 or -(-v // tp) * (tp - 1) < v))
    config = GPTConfig(vocab_size=vocab, block_size=draw(st.integers(2, 5)),
                       n_layer=draw(st.integers(1, 2)), n_head=heads, n_embd=heads * draw(st.integers(1, 2)),
                       norm=draw(st.sampled_from(["layernorm", "rmsnorm"])), bias=draw(st.booleans()),
                       tie_weights=draw(st.booleans()))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    torch.manual_seed(draw(st.integers(0, 2**31)))
    model = GPT(config).to(dtype)
    B = draw(st.integers(0, 6))  # an empty batch, and batches smaller than the data axes, happen
    T = config.block_size
    batches = [(torch.randint(0, config.vocab_size, (B, T)), torch.randint(0, config.vocab_size, (B, T)))
               for _ in range(2)]
    return model, batches, dtype


@settings(max_examples=40)
@given(st.data(), st.sampled_from(MESHES), st.booleans(), st.booleans())
def test_tensor_parallel_steps_equal_unsharded_steps(data, case, private, sequence_parallel):
    name, mesh = case
    model, batches, dtype = data.draw(problems(mesh.axis_size("tp")))
    config = dp_config(private)
    optimizer = optimizer_for(dtype)
    plan = resolve(model, gpt_plan(model.config, sequence_parallel=sequence_parallel), strategies.ALL[name](), mesh)
    ref = baseline(model, batches, optimizer, config)
    got, metrics = tensor_parallel_run(model, batches, optimizer, config, plan, mesh)
    assert_close_to_reference(got, ref, model, TOL[dtype])
    assert len({m["loss"] for m in metrics if m["batch_size"]}) <= 1  # every rank reports the same loss


@settings(max_examples=20)
@given(st.data(), st.sampled_from(MESHES), st.booleans(), st.booleans())
def test_counted_bytes_and_resident_memory_equal_the_cost_model(data, case, private, sequence_parallel):
    """Rank 0 counts exactly ``comm_per_step`` (parameter collectives from the layouts plus the
    activation collectives read off the model), and every rank holds ``memory_by_rank``."""
    name, mesh = case
    model, batches, dtype = data.draw(problems(mesh.axis_size("tp")))
    config = dp_config(private)
    plan = resolve(model, gpt_plan(model.config, sequence_parallel=sequence_parallel), strategies.ALL[name](), mesh)
    _, metrics = tensor_parallel_run(model, batches[:1], sgd(0.1, momentum=0.9), config, plan, mesh)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    units = [list(u.params) for u in make_units(model, shapes)]
    x, y = batches[0]
    acts = activation_collectives(model, plan, mesh, token_loss, x.shape, y.shape, dtype=dtype, private=private)
    assert metrics[0]["comm_bytes"] == comm_per_step(plan, shapes, mesh, units, dtype=dtype, activations=acts)
    memory = memory_by_rank(plan, shapes, mesh, optimizer="sgd_momentum", dtype=dtype)
    assert [m["resident_bytes"] for m in metrics] == memory
