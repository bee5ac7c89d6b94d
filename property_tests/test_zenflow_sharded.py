"""ZenFlow on ZeRO-2/3 row shards == ZenFlow on one unsharded rank: the same columns selected at
every step (bit for bit), the same parameters (float64, rel 1e-10), and each rank's host state
and window accumulators are exactly its own rows of the unsharded ones."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offload
from fsdpx import Mesh, Spec, plan, strategies, unshard
from fsdpx.runtime.threads import run_threads
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import adamw
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.runtime.sharded_state import init_sharded, local_block
from fsdpx.runtime.step import make_sharded_step

F64 = torch.float64
TOL = 1e-10
few = settings(max_examples=12, deadline=None)


def inner():
    # eps as in test_sharded_properties: keeps AdamW Lipschitz where a gradient is rounding noise
    return adamw(1e-2, eps=1e-6, weight_decay=0.05)


def zenflow(combine_scores=None, **kw):
    kw = {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 4, "overlap": False, **kw}
    return offload.zenflow(inner(), combine_scores=combine_scores, **kw)


@st.composite
def problems(draw):
    """A tiny float64 GPT (uneven shapes, tied or untied head) and 6-8 random batches.

    Never LayerNorm of width 2: it maps every 2-vector to ``[a, -a]``, so the two columns of the
    next weight have EQUAL scores in exact arithmetic and the last bit of the gradient (which the
    sharded reduction rounds differently) picks the winner. That is a true tie, not a fault of the
    sharded selection; any other near-tie is a ~1e-16 coincidence."""
    heads = draw(st.integers(1, 2))
    width = heads * draw(st.integers(2, 4))
    config = GPTConfig(vocab_size=draw(st.integers(5, 13)), block_size=draw(st.integers(2, 5)),
                       n_layer=draw(st.integers(1, 2)), n_head=heads, n_embd=width,
                       norm=draw(st.sampled_from(["rmsnorm"] if width == 2 else ["layernorm", "rmsnorm"])),
                       bias=draw(st.booleans()), tie_weights=draw(st.booleans()))
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    model = GPT(config).to(F64)
    B, T = draw(st.integers(1, 6)), config.block_size
    batches = [(torch.randint(0, config.vocab_size, (B, T)), torch.randint(0, config.vocab_size, (B, T)))
               for _ in range(draw(st.integers(6, 8)))]
    return model, batches


def unsharded_run(model, batches, optimizer):
    """Per step: (params, opt_state) of the plain step on the whole batch."""
    state = init_plain(dict(model.named_parameters()), optimizer)
    step, out = make_plain_step(model, token_loss, optimizer), []
    for b in batches:
        state, _ = step(state, b)
        out.append((state.params, offload.materialize(state.opt_state)))
    return out


def sharded_run(model, batches, strategy, mesh, make_optimizer):
    """Per rank, per step: (params at rest, opt_state); each rank builds its own optimizer."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        optimizer = make_optimizer(offload.sharded_scores(comm, strategy.data_axes))
        step = make_sharded_step(copy.deepcopy(model), token_loss, optimizer, strategy, comm, param_shapes=shapes)
        state, out = init_sharded(params, optimizer, strategy, comm, key=0), []
        for b in batches:
            state, _ = step(state, b)
            out.append((state.params, offload.materialize(state.opt_state)))
        return out

    return run_threads(mesh, rank), shapes


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    if not want.numel():
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def check_equal_runs(model, batches, strategy, mesh, make_optimizer):
    want = unsharded_run(model, batches, make_optimizer(None))
    got, shapes = sharded_run(model, batches, strategy, mesh, make_optimizer)
    rows = strategy.opt_state(2)
    for t, (want_params, want_state) in enumerate(want, 1):
        want_elems = offload.element_state(want_state)
        for r, per_step in enumerate(got):
            state = per_step[t - 1][1]
            # the selection is global: bit for bit the unsharded one, on every rank
            assert state["selected"].keys() == want_state["selected"].keys()
            for k, sel in want_state["selected"].items():
                assert torch.equal(state["selected"][k], sel), f"step {t} rank {r} {k}"
            # rows are never mixed: accumulators and host state are this rank's rows only
            assert state["acc"].keys() == want_state["acc"].keys(), f"step {t}"
            for k, acc in want_state["acc"].items():
                mine = local_block(acc, rows, mesh, r)
                assert state["acc"][k].shape == mine.shape, f"step {t} rank {r} {k}"
                assert rel_err(state["acc"][k], mine) <= TOL, f"step {t} rank {r} {k}"
            elems = offload.element_state(state)
            for k, sel in want_state["selected"].items():
                assert torch.equal(elems[k]["count"], want_elems[k]["count"]), f"step {t} {k}"
                for f in ("master", "mu", "nu"):
                    mine = local_block(want_elems[k][f], rows, mesh, r)
                    assert rel_err(elems[k][f], mine) <= TOL, f"step {t} rank {r} {k}.{f}"
        for k, s in shapes.items():
            full = unshard([per_step[t - 1][0][k] for per_step in got], strategy.param_at_rest(len(s)), mesh)
            assert rel_err(full, want_params[k].detach()) <= TOL, f"step {t} {k}"


CASES = [(name, Mesh(dp=n)) for name in ("zero2", "zero3") for n in (1, 2, 3)]


@few
@given(problems(), st.sampled_from(CASES), st.sampled_from([0, 1]))
def test_sharded_zenflow_selects_and_updates_as_the_unsharded_run(problem, case, delay):
    model, batches = problem
    name, mesh = case
    check_equal_runs(model, batches, strategies.ALL[name](), mesh,
                     lambda combine: zenflow(combine, delay=delay))


@settings(max_examples=6, deadline=None)
@given(problems(), st.sampled_from(CASES[1:3] + CASES[4:]), st.sampled_from([0, 1]))
def test_sharded_auto_rules_decide_as_the_unsharded_run(problem, case, delay):
    """The "auto" fire rule sums over the unselected rows and the coverage rule over columns:
    both go through ``combine_scores``, so every rank closes windows and reselects with the
    unsharded run (a rank deciding alone would leave the others waiting in a collective)."""
    model, batches = problem
    name, mesh = case
    check_equal_runs(model, batches, strategies.ALL[name](), mesh,
                     lambda combine: zenflow(combine, delay=delay, update_interval="auto", select_interval="auto",
                                             auto=offload.AutoConfig(coherence=1.2, max_interval=3, coverage=0.95)))


@st.composite
def integer_problems(draw):
    """Two weights and a bias with small-integer gradients: every score and window statistic is
    an exact float64 sum, and equal columns (exact ties) are common."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    out, n_in = draw(st.integers(1, 7)), draw(st.integers(1, 6))
    shapes = {"w": (out, n_in), "v": (draw(st.integers(1, 5)), draw(st.integers(1, 4))), "b": (out,)}
    params = {k: torch.randn(s, dtype=F64, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randint(-2, 3, s, generator=gen).to(F64) for k, s in shapes.items()}
             for _ in range(draw(st.integers(1, 10)))]
    return params, grads


@few
@given(integer_problems(), st.integers(1, 4), st.sampled_from([0, 1]), st.booleans(),
       st.sampled_from([(1, 2), (2, 4), ("auto", 3), (2, "auto"), ("auto", "auto")]))
def test_on_exact_data_sharded_zenflow_is_bit_for_bit_the_unsharded_one(problem, world, delay, overlap, intervals):
    """Row blocks (``torch.chunk``, empty blocks included) of exact gradients: every selection,
    tie-break and "auto" decision and every bit of every rank's state equal the unsharded run's."""
    params, grads = problem
    u, m = intervals
    mesh, rows = Mesh(dp=world), strategies.ALL["zero3"]().opt_state

    def make(combine):
        return offload.zenflow(inner(), topk_ratio=0.34, update_interval=u, select_interval=m, delay=delay,
                               overlap=overlap, combine_scores=combine,
                               auto=offload.AutoConfig(coherence=1.5, max_interval=3, coverage=0.8))

    def run(opt, params, grads):
        state, p, out = opt.init(params), params, []
        for g in grads:
            p, state = opt.update(g, state, p)
            out.append((p, offload.materialize(state)))
        return out

    def block(tree, rank):
        return {k: local_block(t, rows(t.dim()), mesh, rank) for k, t in tree.items()}

    want = run(make(None), params, grads)
    got = run_threads(mesh, lambda comm: run(make(offload.sharded_scores(comm, "dp")), block(params, comm.rank),
                                             [block(g, comm.rank) for g in grads]))
    for t, (want_p, want_state) in enumerate(want):
        for r, per_step in enumerate(got):
            p, state = per_step[t]
            assert state["selected"].keys() == want_state["selected"].keys()
            for k, sel in want_state["selected"].items():
                assert torch.equal(state["selected"][k], sel), f"step {t + 1} rank {r} {k}"
            for k in params:
                assert torch.equal(p[k], block(want_p, r)[k]), f"step {t + 1} rank {r} {k}"
            for k, acc in want_state["acc"].items():
                assert torch.equal(state["acc"][k], local_block(acc, rows(2), mesh, r)), f"step {t + 1} {k}"
            assert state["window_steps"] == want_state["window_steps"]
            assert state["since_selection"] == want_state["since_selection"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_scores_is_one_all_reduce_of_the_row_sums(world):
    mesh = Mesh(dp=world)
    grad = torch.randn(7, 5, dtype=F64, generator=torch.Generator().manual_seed(world))
    rows = strategies.ALL["zero2"]().opt_state(2)

    def rank(comm):
        combine = offload.sharded_scores(comm, "dp")
        scores = combine("w", offload.column_scores(local_block(grad, rows, mesh, comm.rank)))
        return scores, comm.counts()

    results = run_threads(mesh, rank)
    for scores, counts in results:
        assert torch.equal(scores, results[0][0])  # the same bits on every rank
        assert rel_err(scores, offload.column_scores(grad)) <= 1e-15
        [ar] = plan(Spec(None, partial="dp"), Spec(None), (5,), mesh, F64)
        assert counts == {"all_reduce": 40, "send_bytes": ar.send_bytes, "recv_bytes": ar.recv_bytes}


def test_sharded_scores_rejects_what_is_not_a_float64_vector():
    def rank(comm):
        with pytest.raises(TypeError, match="float64"):
            offload.sharded_scores(comm, "dp")("w", torch.zeros(3, dtype=torch.float32))

    run_threads(Mesh(dp=1), rank)
