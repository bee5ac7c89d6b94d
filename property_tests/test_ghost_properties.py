"""Invariants of ghost norms: they equal the vmap reference on every supported model."""

from unittest import mock

import pytest
import torch
from hypothesis import given

from privacy import contributions as C
from privacy.clipping import per_sample_norms
from privacy.errors import UnsupportedLayerError

from support.random_models import Case, any_cases, supported_cases


@given(supported_cases())
def test_ghost_norms_equal_vmap_norms(case: Case):
    ref = per_sample_norms(case.model, case.params, case.batch, case.loss_fn, method="vmap")
    ghost = per_sample_norms(case.model, case.params, case.batch, case.loss_fn, method="ghost")
    torch.testing.assert_close(ghost, ref, rtol=1e-8, atol=1e-12)


@given(any_cases())
def test_auto_norms_equal_vmap_norms_with_unsupported_layers(case: Case):
    ref = per_sample_norms(case.model, case.params, case.batch, case.loss_fn, method="vmap")
    auto = per_sample_norms(case.model, case.params, case.batch, case.loss_fn, method="auto")
    torch.testing.assert_close(auto, ref, rtol=1e-8, atol=1e-12)


@given(any_cases())
def test_ghost_raises_naming_the_unsupported_module(case: Case):
    trainable_custom = any(n.endswith("scale") for n in case.params)
    if not trainable_custom:
        per_sample_norms(case.model, case.params, case.batch, case.loss_fn, method="ghost")
        return
    with pytest.raises(UnsupportedLayerError, match="Scale"):
        per_sample_norms(case.model, case.params, case.batch, case.loss_fn, method="ghost")


@given(supported_cases())
def test_gram_and_instantiated_forms_agree(case: Case):
    """Whatever the cost rule picks, both forms give the same squared norms."""
    from privacy.ghost import contributions
    from privacy.tape import record

    tape = record(case.model, case.params, case.batch, case.loss_fn)
    parts = contributions(case.model, case.params, tape, method="ghost")
    for name, plist in parts.items():
        shape = case.params[name].shape
        a = C.sq_norms(plist, shape)
        b = C.sq_norms(plist, shape, force_instantiate=True)
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


@given(supported_cases())
def test_reused_instantiation_gives_the_same_norms_and_clipped_sums(case: Case):
    """Instantiating every eligible parameter once (unbounded budget) gives the norms and clipped
    sums of the factored forms (budget 0: nothing instantiated)."""
    from privacy.ghost import contributions
    from privacy.tape import record

    shapes = {n: p.shape for n, p in case.params.items()}
    tape = record(case.model, case.params, case.batch, case.loss_fn)
    factored = contributions(case.model, case.params, tape, method="ghost")
    with mock.patch.object(C, "REUSE_MEMORY_MACS", 0):  # every eligible parameter saves: reuse them all
        reused = C.instantiate_for_reuse(dict(factored), shapes, budget_bytes=2**62)
    eligible = [n for n, plist in factored.items() if any(isinstance(p, C.Factored) and not p.one_hot for p in plist)
                and not any(isinstance(p, C.Factored) and p.one_hot for p in plist)]
    assert all(isinstance(reused[n][0], C.Dense) and len(reused[n]) == 1 for n in eligible)
    unchanged = C.instantiate_for_reuse(dict(factored), shapes, budget_bytes=0)
    weights = torch.rand(case.batch[1].shape[0], dtype=torch.float64)
    for name in factored:
        assert unchanged[name] is factored[name]
        torch.testing.assert_close(C.sq_norms(reused[name], shapes[name]), C.sq_norms(factored[name], shapes[name]),
                                   rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(C.weighted_sum(reused[name], weights, shapes[name]),
                                   C.weighted_sum(factored[name], weights, shapes[name]), rtol=1e-8, atol=1e-12)


@given(supported_cases())
def test_weighted_sum_into_a_running_sum(case: Case):
    """``weighted_sum(..., out=acc)`` adds the clipped sum into ``acc`` in place: equal to
    ``acc + weighted_sum(...)`` for factored (dense and one-hot) and instantiated forms."""
    from privacy.ghost import contributions
    from privacy.tape import record

    shapes = {n: p.shape for n, p in case.params.items()}
    tape = record(case.model, case.params, case.batch, case.loss_fn)
    factored = contributions(case.model, case.params, tape, method="ghost")
    with mock.patch.object(C, "REUSE_MEMORY_MACS", 0):
        reused = C.instantiate_for_reuse(dict(factored), shapes, budget_bytes=2**62)
    weights = torch.rand(case.batch[1].shape[0], dtype=torch.float64)
    for parts in (factored, reused):
        for name, plist in parts.items():
            acc = torch.randn(shapes[name], dtype=torch.float64)
            want = acc + C.weighted_sum(plist, weights, shapes[name])
            got = C.weighted_sum(plist, weights, shapes[name], out=acc)
            assert got is acc
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@given(supported_cases())
def test_streamed_clipped_sums_equal_the_factored_forms(case: Case):
    """Streaming every eligible parameter example by example gives the squared norms of the
    factored forms (completed on top of the other parameters' norms) and their clipped sums
    ``sum_i c_i g_i`` with the clipping factors of those norms."""
    from privacy import streaming
    from privacy.clipping import clip_factors
    from privacy.ghost import contributions
    from privacy.tape import record

    shapes = {n: p.shape for n, p in case.params.items()}
    tape = record(case.model, case.params, case.batch, case.loss_fn)
    parts = contributions(case.model, case.params, tape, method="ghost")
    with mock.patch.object(C, "REUSE_MEMORY_MACS", 0), mock.patch.object(streaming, "STREAM_MAX_BYTES", 2**62):
        chosen = streaming.choose_streamed(parts, shapes)
    eligible = [n for n, plist in parts.items() if all(isinstance(p, C.Factored) for p in plist)
                and any(not p.one_hot for p in plist)]
    assert sorted(chosen) == sorted(eligible)
    sq_rest = sum((C.sq_norms(parts[n], shapes[n]) for n in parts if n not in chosen),
                  torch.zeros(case.batch[1].shape[0], dtype=torch.float64))
    clip = 0.5 * float(sq_rest.max().sqrt()) + 1e-3  # clips some examples, not all

    def factor(norm):
        return clip_factors(norm, clip)

    sums, sq = streaming.stream_clipped_sums({n: parts[n] for n in chosen}, shapes, sq_rest, factor)
    full = sum((C.sq_norms(parts[n], shapes[n]) for n in parts), torch.zeros_like(sq_rest))
    torch.testing.assert_close(sq, full, rtol=1e-8, atol=1e-12)
    weights = clip_factors(full.sqrt(), clip)
    for n in chosen:
        torch.testing.assert_close(sums[n], C.weighted_sum(parts[n], weights, shapes[n]), rtol=1e-8, atol=1e-12)
