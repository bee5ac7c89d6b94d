"""Fixed-shape Poisson batches (``privacy.padding``): a padded batch is the unpadded batch.

A batch ``(inputs, targets, mask)`` whose masked rows hold anything (random tokens here, NaN in
one case) gives the steps of the unpadded batch: the same parameters (float64, rel 1e-12), loss,
batch size, clipped fraction and mean norm; private (vmap and ghost, single-process; ghost
sharded under every strategy) and plain. The padding rows sit anywhere in the batch, not only
at the end, so a data-parallel rank may hold only padding. And a run on
``sample_padded_batch`` feeds the model one shape at every step.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import sgd
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.sharding import Mesh, strategies
from privacy.padding import BatchOverflowError, fixed_batch_size, overflow_probability, sample_padded_batch
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, init_state, make_private_step, sample_batch

from support.mesh_runs import sharded_run

TOL = 1e-12
VOCAB, T = 11, 4
SHARDED = [("ddp", Mesh(dp=2)), ("zero2", Mesh(dp=3)), ("zero3", Mesh(dp=2)), ("hsdp", Mesh(replica=2, shard=2))]


def _model(seed: int, tie: bool) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=1, n_head=2, n_embd=4, tie_weights=tie)).double()


def _config(method: str) -> DPConfig:
    return DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method=method)


@st.composite
def padded_runs(draw):
    """Two steps' batches, unpadded and padded: ``B`` real rows (0 to 6) and ``P`` padding rows
    (0 to 5) at random places, padding filled with random tokens."""
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    plain, padded = [], []
    for _ in range(2):
        b, p = draw(st.integers(0, 6)), draw(st.integers(0, 5))
        x, y = torch.randint(0, VOCAB, (b, T), generator=g), torch.randint(0, VOCAB, (b, T), generator=g)
        place = torch.randperm(b + p, generator=g)
        mask = torch.zeros(b + p, dtype=torch.bool)
        mask[place[:b].sort().values] = True
        px = torch.randint(0, VOCAB, (b + p, T), generator=g)
        py = torch.randint(0, VOCAB, (b + p, T), generator=g)
        px[mask], py[mask] = x, y
        plain.append((x, y))
        padded.append((px, py, mask))
    return seed, draw(st.booleans()), plain, padded


def _run(model, batches, config, optimizer):
    params = dict(model.named_parameters())
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, token_loss, optimizer)
    else:
        state = init_state(params, optimizer, key=7, config=config)
        step = make_private_step(model, token_loss, optimizer, config, num_examples=50)
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    return state.params, metrics


def _assert_same(got, want, tol=TOL):
    for k in want:
        scale = max(float(want[k].abs().max()), 1e-30)
        assert float((got[k] - want[k]).abs().max()) / scale <= tol, k


def _assert_same_metrics(got, want):
    for g, w in zip(got, want):
        assert g["batch_size"] == w["batch_size"]
        for key in ("loss", "clipped_fraction", "mean_norm"):
            if key in w:
                if math.isnan(w[key]):
                    assert math.isnan(g[key]), key
                else:
                    assert g[key] == pytest.approx(w[key], rel=TOL, abs=1e-300), key


@settings(max_examples=30)
@given(padded_runs(), st.sampled_from(["vmap", "ghost", "plain"]))
def test_a_padded_step_equals_the_unpadded_step(run, method):
    seed, tie, plain, padded = run
    model = _model(seed, tie)
    config = None if method == "plain" else _config(method)
    want, want_metrics = _run(model, plain, config, sgd(0.1))
    got, got_metrics = _run(model, padded, config, sgd(0.1))
    _assert_same(got, want)
    _assert_same_metrics(got_metrics, want_metrics)


@settings(max_examples=15)
@given(padded_runs(), st.sampled_from(SHARDED), st.booleans())
def test_a_padded_sharded_step_equals_the_unpadded_unsharded_step(run, case, private):
    """Every rank splits the mask with the batch (``privacy.batch.slice_batch``); a rank whose
    rows are all padding adds exact zeros and counts no example."""
    seed, tie, plain, padded = run
    name, mesh = case
    model = _model(seed, tie)
    config = _config("ghost") if private else None
    want, want_metrics = _run(model, plain, config, sgd(0.1))
    got, metrics, _ = sharded_run(model, padded, sgd(0.1), config, strategies.ALL[name](), mesh)
    _assert_same(got, want)
    for rank_metrics in metrics:  # the last step's metrics, every rank
        _assert_same_metrics([rank_metrics], want_metrics[-1:])


def test_a_padding_row_of_nan_contributes_nothing():
    """Whatever a padding row holds: NaN inputs give NaN norms and losses on that row, and the
    step still equals the unpadded one (the row's contributions are zeroed with ``where``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="none")

    x, y = torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 1, 1])
    px = torch.cat([x[:1], torch.full((1, 3), float("nan"), dtype=torch.float64), x[1:]])
    batch = (px, torch.tensor([0, 0, 1, 1]), torch.tensor([True, False, True, True]))
    for method in ("vmap", "ghost"):
        config = _config(method)
        params = dict(model.named_parameters())
        step = make_private_step(model, loss, sgd(0.1), config, num_examples=50)
        want, wm = step(init_state(params, sgd(0.1), key=3, config=config), (x, y))
        got, gm = step(init_state(params, sgd(0.1), key=3, config=config), batch)
        _assert_same(got.params, want.params)
        _assert_same_metrics([gm], [wm])


def test_every_padded_step_feeds_the_model_one_shape():
    """Poisson batch sizes vary step to step; padded to ``fixed_batch_size`` they do not, and
    the private run on them equals the run on the unpadded batches."""
    n, q, steps = 60, 0.1, 6
    g = torch.Generator().manual_seed(0)
    data = (torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g))
    sampler = PoissonSampler(n, q, key=4)
    size = fixed_batch_size(n, q, steps=steps, overflow_bound=1e-6)
    plain = [sample_batch(data, sampler, t) for t in range(steps)]
    padded = [sample_padded_batch(data, sampler, t, size) for t in range(steps)]
    assert len({b[1].shape[0] for b in plain}) > 1  # the raw sizes do vary
    model = _model(0, True)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    try:
        config = DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=q, method="ghost")
        params = dict(model.named_parameters())
        step = make_private_step(model, token_loss, sgd(0.1), config, num_examples=n)
        want, got = init_state(params, sgd(0.1), key=1, config=config), init_state(params, sgd(0.1), key=1,
                                                                                  config=config)
        for a, b in zip(plain, padded):
            want, _ = step(want, a)
            seen.clear()
            got, _ = step(got, b)
            assert seen == [(size, T)]
    finally:
        hook.remove()
    _assert_same(got.params, want.params)


def test_an_overflowing_batch_raises_and_is_never_truncated():
    n, q = 40, 0.5
    data = (torch.arange(n)[:, None].repeat(1, T), torch.arange(n)[:, None].repeat(1, T))
    sampler = PoissonSampler(n, q, key=0)
    size = int(sampler.indices(0).shape[0])
    with pytest.raises(BatchOverflowError) as info:
        sample_padded_batch(data, sampler, 0, size - 1)
    assert info.value.size == size and info.value.max_batch_size == size - 1 and info.value.step == 0
    assert info.value.probability == pytest.approx(overflow_probability(n, q, size - 1))
    inputs, targets, mask = sample_padded_batch(data, sampler, 0, size)  # fits exactly: no padding
    assert bool(mask.all()) and torch.equal(inputs[:, 0], sampler.indices(0))


@settings(max_examples=30)
@given(st.integers(1, 400), st.floats(0.001, 0.9), st.integers(1, 1000), st.sampled_from([1e-3, 1e-6, 1e-9]))
def test_fixed_batch_size_is_the_smallest_within_the_overflow_bound(n, q, steps, bound):
    size = fixed_batch_size(n, q, steps=steps, overflow_bound=bound)
    assert steps * overflow_probability(n + 1, q, size) <= bound
    assert size == 0 or steps * overflow_probability(n + 1, q, size - 1) > bound


@settings(max_examples=30)
@given(st.integers(1, 300), st.floats(0.001, 0.999), st.integers(-1, 300))
@example(199, 0.015625, 176)  # a tail of subnormal terms
def test_overflow_probability_is_the_binomial_upper_tail(n, q, m):
    # the reference in exact rationals: float powers underflow into subnormals (q = 1/64, k = 177:
    # 2**-1062), whose lost bits once put a float reference 6e-9 away from the true tail
    exact_q = Fraction(q)
    want = sum(math.comb(n, k) * exact_q**k * (1 - exact_q) ** (n - k) for k in range(max(m + 1, 0), n + 1))
    assert overflow_probability(n, q, m) == pytest.approx(float(want), rel=1e-9, abs=1e-300)
