"""Ghost clipping on the GPT a user writes the ordinary way (``benchmarks/plain_gpt.py``: biased
``nn.Linear``, ``scaled_dot_product_attention``, positions of shape ``(B, T)`` made by
``expand``), the model ``benchmarks/privacy_step.py --model plain-gpt`` times: per-example norms
and clipped sums equal ``method="vmap"``'s, also with the LM head (tied: the token embedding,
one-hot and dense parts together) streamed example by example, the path the benchmark's shape
takes."""

from __future__ import annotations

import pytest
import torch

from fsdpx.models.gpt import token_loss
from privacy.clipping import clipped_grad
from support.benchmarks import load_benchmark
from support.threads import one_thread  # noqa: F401

PlainGPT = load_benchmark("plain_gpt").PlainGPT
V, T, B, CLIP = 40, 8, 5, 0.05


def model_and_batch(tied: bool):
    torch.manual_seed(0)
    model = PlainGPT(V, T, 16, 2, 2, tied=tied).double()
    x = torch.randint(0, V, (B, T))
    return model, dict(model.named_parameters()), (x, x.roll(1, 1))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
def test_plain_gpt_ghost_norms_and_clipped_sums_equal_vmap(monkeypatch, tied, streamed):
    from privacy import contributions, streaming

    model, params, batch = model_and_batch(tied)
    ref, ref_norms = clipped_grad(model, params, batch, token_loss, clip_norm=CLIP, method="vmap")
    if streamed:  # nothing kept for reuse, so the head (the largest weight) is streamed
        monkeypatch.setattr(contributions, "REUSE_MAX_BYTES", 0)
        monkeypatch.setattr(contributions, "REUSE_MEMORY_MACS", 0)
        chosen = []
        real = streaming.choose_streamed
        monkeypatch.setattr("privacy.clipping.choose_streamed", lambda *a: chosen.extend(real(*a)) or chosen)
    got, norms = clipped_grad(model, params, batch, token_loss, clip_norm=CLIP, method="ghost")
    if streamed:
        assert ("tok.weight" if tied else "head.weight") in chosen
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=1e-14)
    assert (ref_norms > CLIP).all()  # every example is clipped: the factors matter
    for k in params:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-14)
