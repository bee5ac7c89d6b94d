"""Invariants of clipped gradient sums (the DP-SGD sensitivity argument rests on these)."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from privacy.clipping import CLIPPINGS, clip_factors, clipped_grad
from privacy.per_sample import per_sample_grads

from support.random_models import Case, any_cases, supported_cases

clip_norms = st.floats(1e-3, 10.0)


@given(any_cases(), st.sampled_from(["auto", "vmap"]))
def test_clipped_grad_with_infinite_clip_norm_is_the_batch_gradient(case: Case, method: str):
    grads, _ = clipped_grad(case.model, case.params, case.batch, case.loss_fn, clip_norm=math.inf, method=method)
    from torch.func import functional_call

    live = {k: v.detach().requires_grad_() for k, v in case.params.items()}
    loss = case.loss_fn(functional_call(case.model, live, (case.batch[0],)), case.batch[1]).sum()
    ref = torch.autograd.grad(loss, list(live.values()), allow_unused=True)
    for (name, p), r in zip(live.items(), ref):
        torch.testing.assert_close(grads[name], torch.zeros_like(p) if r is None else r, rtol=1e-10, atol=1e-12)


@given(supported_cases(), clip_norms, st.sampled_from(list(CLIPPINGS)))
def test_ghost_clipped_sum_equals_sum_of_clipped_vmap_grads(case: Case, clip_norm: float, clipping: str):
    ghost, norms = clipped_grad(case.model, case.params, case.batch, case.loss_fn, clip_norm=clip_norm,
                                method="ghost", clipping=clipping)
    per_sample = per_sample_grads(case.model, case.params, case.batch, case.loss_fn)
    ref_norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
    c = clip_factors(ref_norms, clip_norm, clipping)
    for name, g in per_sample.items():
        torch.testing.assert_close(ghost[name], torch.einsum("b,b...->...", c, g), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-8, atol=1e-12)


@given(any_cases(), clip_norms, st.sampled_from(list(CLIPPINGS)))
def test_every_clipped_contribution_is_within_clip_norm(case: Case, clip_norm: float, clipping: str):
    """Clipping each example alone (batch of one) bounds its contribution: the sensitivity."""
    x, y = case.batch
    for i in range(y.shape[0]):
        one = (x[i:i + 1], y[i:i + 1])
        g, _ = clipped_grad(case.model, case.params, one, case.loss_fn, clip_norm=clip_norm, clipping=clipping)
        norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
        assert norm <= clip_norm * (1 + 1e-9)


@given(supported_cases())
def test_empty_batch_gives_zero_gradient(case: Case):
    x, y = case.batch
    grads, norms = clipped_grad(case.model, case.params, (x[:0], y[:0]), case.loss_fn, clip_norm=1.0)
    assert norms.shape == (0,)
    for name, p in case.params.items():
        assert torch.equal(grads[name], torch.zeros_like(p))
