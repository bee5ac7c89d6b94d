"""Sharded == unsharded: every strategy, meshes of 1-4 simulated ranks, random small GPTs
(uneven shapes, tied or untied head), plain and private with the same key."""

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx import Mesh, comm_per_step, memory_by_rank, strategies, unshard
from fsdpx.runtime.threads import run_threads
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import adamw, sgd
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.units import make_units
from privacy.step import DPConfig, init_state, make_private_step

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


def _baseline(model, batches, optimizer, config):
    params = dict(model.named_parameters())
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, token_loss, optimizer)
    else:
        state = init_state(params, optimizer, key=7, config=config)
        step = make_private_step(model, token_loss, optimizer, config, num_examples=50)
    for b in batches:
        state, _ = step(state, b)
    return state.params


def _sharded(model, batches, optimizer, config, strategy, mesh, donate=False):
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        m = copy.deepcopy(model)
        step = make_sharded_step(m, token_loss, optimizer, strategy, comm, param_shapes=shapes, config=config,
                                 num_examples=50, donate=donate)
        state = init_sharded(params, optimizer, strategy, comm, key=7, config=config)
        for b in batches:
            state, metrics = step(state, b)
        return state, metrics

    results = run_threads(mesh, rank)
    full = {k: unshard([r[0].params[k] for r in results], strategy.param_at_rest(len(s)), mesh)
            for k, s in shapes.items()}
    return full, [r[1] for r in results], shapes


def _dp_config(private: bool) -> DPConfig | None:
    """The privacy knobs of the private cases (ghost clipping: the sharded runtime's method)."""
    return DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="ghost") if private else None


def _optimizer(dtype):
    """AdamW divides by sqrt(v): a gradient that is 0 in exact arithmetic (the attention key
    bias, everything after a LayerNorm of width 1) but rounding noise in practice becomes an
    lr-sized step of random sign, in any two runs that round differently. A larger eps bounds
    that amplification by lr / eps = 1e3, which keeps noise of ~1e-16 at ~1e-13, well under the
    float64 tolerance (eps=1e-6 left a width-1 model at 1.04e-10 of its 1e-10); float32 rounding
    is too coarse for any AdamW comparison at 1e-5, so float32 uses SGD with momentum."""
    return adamw(1e-2, eps=1e-5, weight_decay=0.05) if dtype == torch.float64 else sgd(0.1, momentum=0.9)


@settings(max_examples=25)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_sharded_steps_equal_unsharded_steps(problem, case, private):
    model, batches, dtype = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = _dp_config(private)
    optimizer = _optimizer(dtype)
    ref = _baseline(model, batches, optimizer, config)
    got, metrics, shapes = _sharded(model, batches, optimizer, config, strategy, mesh)
    _assert_close_to_reference(got, ref, model, TOL[dtype])


def _assert_close_to_reference(got, ref, model, tol):
    """Each parameter within ``tol`` of the reference, relative to the larger of its own size and
    the largest change any parameter made. Sharding reorders float sums, so errors scale with the
    updates; a parameter whose update nearly cancelled (a bias near zero after two noisy steps)
    would otherwise be judged against its own tiny value, not against the sums that rounded."""
    init = dict(model.named_parameters())
    moved = max(float((ref[k] - init[k].detach()).abs().max()) for k in ref) if ref else 0.0
    for k in ref:
        scale = max(float(ref[k].abs().max()), moved, 1e-30)
        assert float((got[k] - ref[k]).abs().max()) / scale <= tol, k


@settings(max_examples=12)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_counted_bytes_and_resident_memory_equal_the_cost_model(problem, case, private):
    model, batches, dtype = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = _dp_config(private)
    _, metrics, shapes = _sharded(model, batches, sgd(0.1, momentum=0.9), config, strategy, mesh)
    units = [list(u.params) for u in make_units(model, shapes)]
    assert metrics[0]["comm"] == comm_per_step(strategy, shapes, mesh, units, dtype=dtype)
    memory = memory_by_rank(strategy, shapes, mesh, optimizer="sgd_momentum", dtype=dtype)
    assert [m["resident_bytes"] for m in metrics] == memory


@settings(max_examples=12)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_donated_state_gives_the_same_bits(problem, case, private):
    """``donate=True`` (AdamW writes into the state's tensors) == the pure step, bit for bit."""
    model, batches, dtype = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = _dp_config(private)
    optimizer = adamw(1e-2, eps=1e-6, weight_decay=0.05)
    pure, _, _ = _sharded(model, batches, optimizer, config, strategy, mesh)
    donated, _, _ = _sharded(model, batches, optimizer, config, strategy, mesh, donate=True)
    for k in pure:
        assert torch.equal(pure[k], donated[k]), k
