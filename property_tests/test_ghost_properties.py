"""Invariants of ghost norms: they equal the vmap reference on every supported model."""

from unittest import mock

import pytest
import torch
from hypothesis import given

from privacy import contributions as C
from privacy.clipping import per_sample_norms
from privacy.errors import UnsupportedLayerError
from random_models import Case, any_cases, supported_cases


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
