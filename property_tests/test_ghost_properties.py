"""Invariants of ghost norms: they equal the vmap reference on every supported model."""

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
