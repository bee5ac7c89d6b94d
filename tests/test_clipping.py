"""Unit tests of the clipping API: bad input gets a named error; non-finite examples."""

import math

import pytest
import torch
from torch import nn

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from privacy.clipping import clip_factors, clipped_grad, per_sample_norms
from privacy.errors import NonFiniteGradientError, PrivacyError


def mse(out, y):
    return (out - y).pow(2).sum(1)


@pytest.fixture
def linear_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    return model, dict(model.named_parameters()), (x, y)


@pytest.mark.parametrize("clip_norm", [0.0, -1.0, math.nan])
def test_non_positive_clip_norm_is_rejected(linear_case, clip_norm):
    model, params, batch = linear_case
    with pytest.raises(PrivacyError, match="clip_norm"):
        clipped_grad(model, params, batch, mse, clip_norm=clip_norm)


def test_unknown_method_and_clipping_are_rejected(linear_case):
    model, params, batch = linear_case
    with pytest.raises(PrivacyError, match="method"):
        clipped_grad(model, params, batch, mse, clip_norm=1.0, method="hooks")
    with pytest.raises(PrivacyError, match="clipping"):
        clipped_grad(model, params, batch, mse, clip_norm=1.0, clipping="per_layer")


def test_params_not_in_the_model_are_named(linear_case):
    model, params, batch = linear_case
    params = {**params, "9.weight": torch.zeros(2, 2, dtype=torch.float64)}
    with pytest.raises(KeyError, match="9.weight"):
        clipped_grad(model, params, batch, mse, clip_norm=1.0)


def test_loss_fn_must_return_one_loss_per_example(linear_case):
    model, params, batch = linear_case
    with pytest.raises(ValueError, match=r"one loss per example, shape \(5,\)"):
        clipped_grad(model, params, batch, lambda o, y: mse(o, y).sum(), clip_norm=1.0)


def test_layer_without_batch_dimension_is_named():
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(4, 2)

        def forward(self, x):
            return x + self.table(torch.arange(2))  # (2, 2) broadcast over the batch

    model = Broadcast().double()
    x = torch.randn(3, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="'table'.*batch"):
        clipped_grad(model, dict(model.named_parameters()), (x, x), lambda o, y: (o - y).pow(2).sum((1, 2)),
                     clip_norm=1.0)


@pytest.fixture(params=["streamed", "factored"])
def streaming_mode(request, monkeypatch):
    """``streamed``: no batch reuse, so the weights are streamed example by example;
    ``factored``: nothing instantiated, nothing streamed (Gram norms, ``L^T diag(c) R`` sums)."""
    from privacy import contributions, streaming
    monkeypatch.setattr(contributions, "REUSE_MAX_BYTES", 0)
    monkeypatch.setattr(contributions, "REUSE_MEMORY_MACS", 0)
    if request.param == "factored":
        monkeypatch.setattr(streaming, "STREAM_MAX_BYTES", 0)
    return request.param


def test_non_finite_examples_are_named_or_zeroed(linear_case, streaming_mode):
    model, params, (x, y) = linear_case
    y = y.clone()
    y[1, 0] = math.inf
    y[3, 1] = math.nan
    with pytest.raises(NonFiniteGradientError, match=r"\[1, 3\]") as err:
        clipped_grad(model, params, (x, y), mse, clip_norm=1.0)
    assert err.value.indices == [1, 3]
    grads, norms = clipped_grad(model, params, (x, y), mse, clip_norm=1.0, nonfinite="zero")
    keep = torch.tensor([0, 2, 4])
    ref, _ = clipped_grad(model, params, (x[keep], y[keep]), mse, clip_norm=1.0)
    for k in params:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-12, atol=1e-14)
    assert torch.isfinite(grads["0.weight"]).all()


def test_clip_factors_edge_cases():
    norms = torch.tensor([0.0, 0.5, 2.0, math.inf])
    assert clip_factors(norms, 1.0).tolist() == [1.0, 1.0, 0.5, 0.0]
    assert clip_factors(norms, math.inf).tolist() == [1.0, 1.0, 1.0, 1.0]
    auto = clip_factors(norms[:3], 1.0, "automatic")
    assert torch.all(auto * norms[:3] <= 1.0)
    with pytest.raises(PrivacyError, match="finite"):
        clip_factors(norms, math.inf, "automatic")


def test_frozen_parameters_get_no_gradient_and_no_norm(linear_case):
    model, params, batch = linear_case
    trainable = {k: v for k, v in params.items() if k.startswith("2.")}
    grads, norms = clipped_grad(model, trainable, batch, mse, clip_norm=math.inf)
    assert set(grads) == {"2.weight", "2.bias"}
    ref = per_sample_norms(model, trainable, batch, mse, method="vmap")
    torch.testing.assert_close(norms, ref, rtol=1e-10, atol=0)


def test_gpt_tied_head_norms_include_the_cross_term():
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=20, block_size=6, n_layer=1, n_head=1, n_embd=8)).double()
    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params  # tied: one canonical name
    ids = torch.randint(0, 20, (4, 6))
    batch = (ids, ids.roll(1, 1))
    ghost = per_sample_norms(model, params, batch, token_loss, method="ghost")
    torch.testing.assert_close(ghost, per_sample_norms(model, params, batch, token_loss, method="vmap"),
                               rtol=1e-8, atol=0)


def test_ghost_backward_computes_no_weight_gradient(linear_case, monkeypatch):
    """One backward, and autograd is never asked for parameter gradients (book-keeping)."""
    model, params, batch = linear_case
    calls = []
    real = torch.autograd.grad

    def counting(outputs, inputs, *a, **k):
        calls.append([e.node.name() for e in inputs])  # the tape asks by autograd edge
        return real(outputs, inputs, *a, **k)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    clipped_grad(model, params, batch, mse, clip_norm=1.0, method="ghost")
    assert len(calls) == 1
    assert calls[0] and not any("AccumulateGrad" in name for name in calls[0])  # layer outputs only, no leaf


def test_embedding_on_expanded_non_contiguous_ids_matches_vmap():
    """Opacus 1.6's ghost mode crashes on non-contiguous ids; ours reshapes."""
    torch.manual_seed(2)
    emb = nn.Embedding(6, 3).double()

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = emb

        def forward(self, x):
            B, T = x.shape
            return self.emb(torch.arange(T).expand(B, T)) * x[..., None]

    model = Positions()
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.randn(4, 5, 3, dtype=torch.float64)
    loss = lambda o, t: (o - t).pow(2).sum((1, 2))
    params = dict(model.named_parameters())
    ghost = per_sample_norms(model, params, (x, y), loss, method="ghost")
    torch.testing.assert_close(ghost, per_sample_norms(model, params, (x, y), loss, method="vmap"), rtol=1e-10, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_streaming_the_lm_head_gives_the_clipped_grad_of_the_factored_forms(monkeypatch, tied):
    """On a GPT (float64) with nothing reused in batch, streaming takes the LM head (tied:
    the shared embedding, one-hot and dense parts together); the clipped gradient and norms
    equal those with nothing streamed."""
    from privacy import contributions, streaming
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_weights=tied)).double()
    params = dict(model.named_parameters())
    x = torch.randint(0, 64, (5, 8))
    monkeypatch.setattr(contributions, "REUSE_MAX_BYTES", 0)
    monkeypatch.setattr(contributions, "REUSE_MEMORY_MACS", 0)  # so small a model saves nothing otherwise
    chosen = []
    real = streaming.choose_streamed

    def recording(*args):
        names = real(*args)
        chosen.extend(names)
        return names

    monkeypatch.setattr("privacy.clipping.choose_streamed", recording)
    got, got_norms = clipped_grad(model, params, (x, x.roll(1, 1)), token_loss, clip_norm=0.05)
    assert [n for n in chosen if params[n].shape == (64, 16)]  # the LM head's weight
    monkeypatch.setattr(streaming, "STREAM_MAX_BYTES", 0)
    ref, ref_norms = clipped_grad(model, params, (x, x.roll(1, 1)), token_loss, clip_norm=0.05)
    torch.testing.assert_close(got_norms, ref_norms, rtol=1e-10, atol=1e-14)
    assert (got_norms > 0.05).any()  # some examples are clipped
    for k in params:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-14)
