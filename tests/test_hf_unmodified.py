"""transformers models, unmodified, through every privacy method (issue 14, section 1).

GPT-2 (tied ``wte``/``lm_head``, ``Conv1D``, position ids ``[1, T]`` broadcast over the batch),
Llama (``LlamaRMSNorm``, rotary, grouped-query attention) and a BERT classifier, each built from
a tiny local config and called the way transformers documents: ``model(**inputs)`` with an
attention mask, right padding, and ``-100`` labels on pads. No wrapper. Every per-example norm
and clipped sum is judged against the oracle of ``support.oracle.loop_grads`` (one example at a
time, plain autograd, float64).
"""

from __future__ import annotations

import pytest
import torch

from support.hf import T, bert, cls_loss, gpt2, llama, lm_loss, padded_batch, unpadded
from support.oracle import clipped_sum_of, loop_grads, norms_of
from support.tolerance import assert_close, float32_ops
from privacy import clipped_grad, per_sample_grads, per_sample_norms

pytest.importorskip("transformers")

METHODS = ("vmap", "ghost", "auto")
LENGTHS = [5, 8, 3]  # example 1 fills the window; 0 and 2 are padded
CLIP = 0.5

MODELS = {
    "gpt2-eager": (lambda: gpt2("eager"), lm_loss, True),
    "gpt2-sdpa": (lambda: gpt2("sdpa"), lm_loss, True),
    "llama-sdpa": (lambda: llama("sdpa"), lm_loss, True),
    "llama-eager-tied": (lambda: llama("eager", tied=True), lm_loss, True),
    "bert-eager": (lambda: bert("eager"), cls_loss, False),
    "bert-sdpa": (lambda: bert("sdpa"), cls_loss, False),
}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    build, loss_fn, causal = MODELS[request.param]
    model = build().eval()
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=causal)
    f32 = bool(float32_ops(model, batch[0]))  # Llama: RMSNorm (and eager softmax) in float32
    return model, params, batch, loss_fn, loop_grads(model, params, batch, loss_fn), f32


@pytest.mark.parametrize("method", METHODS)
def test_per_example_norms_and_clipped_sums_equal_a_per_example_autograd_loop(case, method):
    model, params, batch, loss_fn, oracle, f32 = case
    norms = per_sample_norms(model, params, batch, loss_fn, method=method)
    assert_close(norms, norms_of(oracle), f32)
    grads, clip_norms = clipped_grad(model, params, batch, loss_fn, clip_norm=CLIP, method=method)
    assert_close(clip_norms, norms_of(oracle), f32)
    want = clipped_sum_of(oracle, CLIP)
    for name in params:
        assert_close(grads[name], want[name], f32, msg=name)


@pytest.mark.parametrize("method", ("vmap", "ghost"))
def test_padding_tokens_contribute_nothing_to_an_example(case, method):
    """A padded batch's clipped sum is the sum of each example's clipped gradient computed
    without any padding (example alone, cut to its length): pads (mask 0, label -100) add
    nothing to any example's gradient or norm."""
    model, params, batch, loss_fn, _, f32 = case
    grads, norms = clipped_grad(model, params, batch, loss_fn, clip_norm=CLIP, method=method)
    want = {k: torch.zeros_like(v) for k, v in params.items()}
    for i, length in enumerate(LENGTHS):
        alone = unpadded(*batch, i, length)
        g, n = clipped_grad(model, params, alone, loss_fn, clip_norm=CLIP, method=method)
        assert_close(norms[i:i + 1], n, f32)
        want = {k: want[k] + g[k] for k in want}
    for name in params:
        assert_close(grads[name], want[name], f32, msg=name)


def test_plain_gpt2_gets_per_example_position_gradients_from_positional_ids():
    """``model(ids)`` with no mask: transformers looks ``wpe`` up with positions ``[1, T]``;
    every example still gets its own ``wpe`` gradient (it trains, nothing is frozen)."""
    model = gpt2().eval()
    params = dict(model.named_parameters())
    ids = padded_batch([T, T, T], causal=True)[0]["input_ids"]
    batch = (ids, ids)
    f32 = bool(float32_ops(model, ids))
    oracle = loop_grads(model, params, batch, lm_loss)
    ghost = per_sample_norms(model, params, batch, lm_loss, method="ghost")
    assert_close(ghost, norms_of(oracle), f32)
    wpe = per_sample_grads(model, params, batch, lm_loss)["transformer.wpe.weight"]
    assert_close(wpe, oracle["transformer.wpe.weight"], f32)
    assert (wpe.flatten(1).norm(dim=1) > 0).all() and not torch.allclose(wpe[0], wpe[1])


@pytest.mark.parametrize("method", ("ghost", "auto"))
def test_with_dropout_in_training_mode_unclipped_ghost_is_the_batch_gradient_of_the_same_draw(method):
    """A model built from a config is in training mode with dropout on. The tape's one forward
    draws the dropout masks; with the same seed a plain autograd run draws the same ones, and
    an infinite clip norm must give its gradient of the summed loss."""
    model = gpt2(dropout=0.2)
    assert model.training
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=True)
    f32 = bool(float32_ops(model, batch[0]))
    torch.manual_seed(7)
    grads, norms = clipped_grad(model, params, batch, lm_loss, clip_norm=float("inf"), method=method)
    torch.manual_seed(7)
    loss = lm_loss(model(**batch[0]), batch[1]).sum()
    want = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    for name in params:
        assert_close(grads[name], want[name], f32, msg=name)
    assert torch.isfinite(norms).all()


def test_vmap_with_dropout_in_training_mode_draws_per_example_masks():
    model = gpt2(dropout=0.2)
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=True)
    norms = per_sample_norms(model, params, batch, lm_loss, method="vmap")
    assert norms.shape == (3,) and torch.isfinite(norms).all()
