"""Sharded == unsharded: every strategy, meshes of 1-4 simulated ranks, random small GPTs
(uneven shapes, tied or untied head), plain and private with the same key."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx import Mesh, comm_per_step, memory_by_rank, strategies
from fsdpx.models.gpt import GPT, GPTConfig
from fsdpx.optim import adamw, sgd
from fsdpx.runtime.units import make_units

from support.mesh_runs import sharded_run
from support.reference import assert_close_to_reference, baseline, dp_config, optimizer_for

MESHES = {
    "ddp": [Mesh(dp=1), Mesh(dp=2), Mesh(dp=3), Mesh(dp=4)],
    "zero1": [Mesh(dp=2), Mesh(dp=3)],
    "zero2": [Mesh(dp=2), Mesh(dp=4)],
    "zero3": [Mesh(dp=1), Mesh(dp=2), Mesh(dp=3), Mesh(dp=4)],
    "hsdp": [Mesh(replica=2, shard=2), Mesh(replica=1, shard=3), Mesh(replica=2, shard=1)],
}
CASES = [(name, mesh) for name, meshes in MESHES.items() for mesh in meshes]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@st.composite
def problems(draw):
    heads = draw(st.integers(1, 2))
    config = GPTConfig(vocab_size=draw(st.integers(5, 13)), block_size=draw(st.integers(2, 5)),
                       n_layer=draw(st.integers(1, 2)), n_head=heads, n_embd=heads * draw(st.integers(1, 3)),
                       norm=draw(st.sampled_from(["layernorm", "rmsnorm"])), bias=draw(st.booleans()),
                       tie_weights=draw(st.booleans()))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    torch.manual_seed(draw(st.integers(0, 2**31)))
    model = GPT(config).to(dtype)
    B = draw(st.integers(0, 7))  # an empty batch, and batches smaller than the mesh, happen
    T = config.block_size
    batches = [(torch.randint(0, config.vocab_size, (B, T)), torch.randint(0, config.vocab_size, (B, T)))
               for _ in range(2)]
    return model, batches, dtype


@settings(max_examples=25)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_sharded_steps_equal_unsharded_steps(problem, case, private):
    model, batches, dtype = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = dp_config(private)
    optimizer = optimizer_for(dtype)
    ref = baseline(model, batches, optimizer, config)
    got, metrics, shapes = sharded_run(model, batches, optimizer, config, strategy, mesh)
    assert_close_to_reference(got, ref, model, TOL[dtype])


@settings(max_examples=12)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_counted_bytes_and_resident_memory_equal_the_cost_model(problem, case, private):
    model, batches, dtype = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = dp_config(private)
    _, metrics, shapes = sharded_run(model, batches, sgd(0.1, momentum=0.9), config, strategy, mesh)
    units = [list(u.params) for u in make_units(model, shapes)]
    assert metrics[0]["comm_bytes"] == comm_per_step(strategy, shapes, mesh, units, dtype=dtype)
    memory = memory_by_rank(strategy, shapes, mesh, optimizer="sgd_momentum", dtype=dtype)
    assert [m["resident_bytes"] for m in metrics] == memory


@settings(max_examples=12)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_donated_state_gives_the_same_bits(problem, case, private):
    """``donate=True`` (AdamW writes into the state's tensors) == the pure step, bit for bit."""
    model, batches, dtype = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = dp_config(private)
    optimizer = adamw(1e-2, eps=1e-6, weight_decay=0.05)
    pure, _, _ = sharded_run(model, batches, optimizer, config, strategy, mesh)
    donated, _, _ = sharded_run(model, batches, optimizer, config, strategy, mesh, donate=True)
    for k in pure:
        assert torch.equal(pure[k], donated[k]), k
