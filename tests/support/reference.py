"""The unsharded run a sharded one is judged against (random small GPTs, ``token_loss``), its
knobs (privacy, optimizer) and the judgment: each parameter within a tolerance relative to the
larger of its size and the largest update."""

from __future__ import annotations

import torch

from fsdpx.models.gpt import token_loss
from fsdpx.optim import adamw, sgd
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from privacy.step import DPConfig, init_state, make_private_step


def baseline(model, batches, optimizer, config):
    """The parameters after one unsharded step of ``model`` per batch of ``batches`` (``token_loss``;
    plain when ``config`` is None, else private with key 7 and 50 examples): the reference a
    sharded run is judged against."""
    params = dict(model.named_parameters())
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, token_loss, optimizer)
    else:
        state = init_state(params, optimizer, key=7, config=config)
        step = make_private_step(model, token_loss, optimizer, config, num_examples=50)
    for b in batches:
        state, _ = step(state, b)
    return state.params


def dp_config(private: bool) -> DPConfig | None:
    """The privacy knobs of the private cases (ghost clipping: the sharded runtime's method)."""
    return DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="ghost") if private else None


def optimizer_for(dtype):
    """The optimizer of the comparisons in ``dtype``: AdamW (eps 1e-5) in float64, SGD with
    momentum in float32.

    AdamW divides by sqrt(v): a gradient that is 0 in exact arithmetic (the attention key
    bias, everything after a LayerNorm of width 1) but rounding noise in practice becomes an
    lr-sized step of random sign, in any two runs that round differently. A larger eps bounds
    that amplification by lr / eps = 1e3, which keeps noise of ~1e-16 at ~1e-13, well under the
    float64 tolerance (eps=1e-6 left a width-1 model at 1.04e-10 of its 1e-10); float32 rounding
    is too coarse for any AdamW comparison at 1e-5, so float32 uses SGD with momentum."""
    return adamw(1e-2, eps=1e-5, weight_decay=0.05) if dtype == torch.float64 else sgd(0.1, momentum=0.9)


def assert_close_to_reference(got, ref, model, tol):
    """Each parameter within ``tol`` of the reference, relative to the larger of its own size and
    the largest change any parameter made. Sharding reorders float sums, so errors scale with the
    updates; a parameter whose update nearly cancelled (a bias near zero after two noisy steps)
    would otherwise be judged against its own tiny value, not against the sums that rounded."""
    init = dict(model.named_parameters())
    moved = max(float((ref[k] - init[k].detach()).abs().max()) for k in ref) if ref else 0.0
    for k in ref:
        scale = max(float(ref[k].abs().max()), moved, 1e-30)
        assert float((got[k] - ref[k]).abs().max()) / scale <= tol, k
