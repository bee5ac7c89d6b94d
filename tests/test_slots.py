"""``fsdpx.runtime.slots.Slots``: swapping named tensors by resolved place, as NamedMemberAccessor does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from fsdpx.models.gpt import GPT, GPTConfig
from fsdpx.runtime.slots import Slots


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=4, tie_weights=True))
    model.register_buffer("scale", torch.ones(3))
    model.extra = torch.zeros(2)  # a plain tensor attribute: swapped through the accessor
    return model


def _named(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)] + ["scale", "extra"]


def test_slots_swap_like_accessor():
    names = _named(_model())
    new = {n: torch.full((1,), float(i)) for i, n in enumerate(names)}
    a, b = _model(), _model()
    old_a = NamedMemberAccessor(a).swap_tensors_dict(dict(new), allow_missing=True)[0]
    old_b = Slots(b, names).swap(dict(new))
    acc_a, acc_b = NamedMemberAccessor(a), NamedMemberAccessor(b)
    for n in names:  # the same tensors in the same places, the same originals handed back
        assert acc_a.get_tensor(n) is new[n] and acc_b.get_tensor(n) is new[n]
        assert torch.equal(old_a[n], old_b[n])
    back = Slots(b, names).swap(old_b)  # undoing puts every original back, by identity
    assert all(back[n] is new[n] and acc_b.get_tensor(n) is old_b[n] for n in names)
    assert [n for n, _ in b.named_parameters(remove_duplicate=False)] == names[:-2]


def test_slots_resolved_once_survive_a_changed_module_tree():
    model = _model()
    slots = Slots(model, ["blocks.1.ln_1.weight"])
    saved = model.blocks._modules
    model.blocks._modules = {"0": saved["0"]}  # a stage holding only block 0, as StageForward does
    try:
        old = slots.swap({"blocks.1.ln_1.weight": torch.zeros(4)})
    finally:
        model.blocks._modules = saved
    assert torch.equal(model.blocks[1].ln_1.weight, torch.zeros(4))
    slots.swap(old)
    assert model.blocks[1].ln_1.weight is old["blocks.1.ln_1.weight"]


def test_an_unknown_name_swaps_nothing():
    model = _model()
    slots = Slots(model, ["wte.weight"])
    before = model.wte.weight
    with pytest.raises(KeyError):
        slots.swap({"wte.weight": torch.zeros(1), "no.such": torch.zeros(1)})
    assert model.wte.weight is before
