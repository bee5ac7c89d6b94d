"""A transformers GPT-2 built from a tiny config (tied wte / lm_head), unwrapped: ghost == vmap.

``GPT2LMHeadModel`` looks ``wpe`` up with position ids ``[1, T]`` broadcast over the batch; the
tape expands that call to the batch, so ``wpe`` trains with per-example gradients too."""

import pytest
import torch

from fsdpx.models.gpt import token_loss
from privacy.clipping import clipped_grad, per_sample_norms
from privacy.per_sample import per_sample_grads

transformers = pytest.importorskip("transformers")


def hf_token_loss(out, targets: torch.Tensor) -> torch.Tensor:
    return token_loss(out.logits, targets)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=8, n_embd=12, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 40, (3, 8))
    return model, dict(model.named_parameters()), (ids, torch.roll(ids, -1, 1))


def test_hf_gpt2_ghost_norms_equal_vmap_with_tied_embeddings(gpt2):
    model, params, batch = gpt2
    ref = per_sample_norms(model, params, batch, hf_token_loss, method="vmap")
    ghost = per_sample_norms(model, params, batch, hf_token_loss, method="ghost")
    torch.testing.assert_close(ghost, ref, rtol=1e-8, atol=0)


def test_hf_gpt2_ghost_clipped_sum_equals_vmap(gpt2):
    model, params, batch = gpt2
    ghost, norms = clipped_grad(model, params, batch, hf_token_loss, clip_norm=0.1, method="ghost")
    per_sample = per_sample_grads(model, params, batch, hf_token_loss)
    c = torch.clamp(0.1 / norms, max=1.0)
    for name, g in per_sample.items():
        torch.testing.assert_close(ghost[name], torch.einsum("b,b...->...", c, g), rtol=1e-8, atol=1e-14)
