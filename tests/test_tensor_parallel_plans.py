"""Tensor-parallel plans resolve to per-parameter layouts, and misfits are named before any
collective runs."""

import pytest
import torch
from torch import nn

from fsdpx.models.gpt import GPT, GPTConfig
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.sharding import Mesh, Spec, strategies
from fsdpx.sharding.tensor_parallel import (
    ColumnParallel,
    RowParallel,
    TensorParallel,
    TensorParallelPlanError,
    VocabParallelEmbedding,
    resolve,
)

CONFIG = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=4, n_embd=8)


@pytest.mark.parametrize("name", sorted(strategies.ALL))
def test_a_strategy_over_replicated_compute_is_the_strategy(name):
    """DDP / ZeRO / HSDP as plan builders: composing with no tensor parallelism changes nothing."""
    s = strategies.ALL[name]()
    for shape in [(), (5,), (5, 3), (2, 3, 4)]:
        assert s.layout_over(shape, Spec.replicated(len(shape))) == s.layout(shape)
    model = GPT(CONFIG)
    mesh = Mesh(**{a: 2 for a in s.data_axes})
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert resolve(model, None, s, mesh) == s.resolve(shapes)


def test_the_gpt_plan_splits_megatron_style_and_zero3_cuts_each_block_again():
    model = GPT(CONFIG)
    plan = resolve(model, gpt_plan(CONFIG), strategies.zero3(), Mesh(dp=2, tp=2))
    qkv = plan.params["blocks.0.attn.qkv.weight"]
    assert qkv.shape == (3, 8, 8) and qkv.fused == (0, 3)  # q|k|v, each split by heads
    assert qkv.compute == Spec(None, "tp", None) and qkv.at_rest == Spec(None, ("tp", "dp"), None)
    assert plan.params["blocks.0.attn.proj.weight"].compute == Spec(None, "tp")  # row-parallel
    assert plan.params["blocks.0.attn.proj.weight"].at_rest == Spec("dp", "tp")
    assert plan.params["blocks.0.attn.proj.bias"].compute == Spec(None)  # added once, after the sum
    assert plan.params["blocks.0.mlp.fc.bias"].compute == Spec("tp")
    assert plan.params["wte.weight"].compute == Spec("tp", None)  # tied with the LM head: one layout
    assert "lm_head.weight" not in plan.params  # a tied parameter has one canonical name
    assert plan.params["blocks.0.ln_1.weight"] == strategies.zero3().layout((8,))  # replicated over tp
    for lay in plan.params.values():
        assert "tp" not in lay.raw_grad.partial  # no sequence parallelism: nothing partial over tp


@pytest.mark.parametrize("plan, mesh, message", [
    (gpt_plan(CONFIG), Mesh(dp=1, tp=3), "'blocks.0.attn.qkv': 4 heads do not divide by tp=3"),
    (gpt_plan(CONFIG), Mesh(dp=2), "splits over axis 'tp', which Mesh(dp=2) lacks"),
    (TensorParallel({"blocks.*.attn.nope": RowParallel()}), Mesh(dp=1, tp=2), "'blocks.*.attn.nope' matches no module"),
    (TensorParallel({"blocks.*.attn.qkv": ColumnParallel(), "blocks.0.*.qkv": RowParallel()}), Mesh(dp=1, tp=2),
     "'blocks.0.attn.qkv' is matched by two patterns"),
    (TensorParallel({"wte": VocabParallelEmbedding(), "lm_head": RowParallel()}), Mesh(dp=1, tp=2),
     "tied parameter 'wte.weight' gets two layouts"),
    (TensorParallel({"blocks.0.ln_1": ColumnParallel()}), Mesh(dp=1, tp=2), "cannot be ColumnParallel"),
    (TensorParallel({"wte": VocabParallelEmbedding()}), Mesh(dp=1, tp=8), "leaves rank 7 without rows"),
    (gpt_plan(CONFIG, axis="dp"), Mesh(dp=2), "cannot carry both data and tensor parallelism"),
])
def test_plans_that_do_not_fit_are_named_before_anything_runs(plan, mesh, message):
    with pytest.raises(TensorParallelPlanError) as e:
        resolve(GPT(CONFIG), plan, strategies.zero3(), mesh)
    assert message in str(e.value)


def test_fused_blocks_that_do_not_divide_are_named():
    model = nn.Sequential(nn.Linear(4, 10))
    with pytest.raises(TensorParallelPlanError, match="'0': 10 output features do not split into 3 fused blocks"):
        resolve(model, TensorParallel({"0": ColumnParallel(fused=3)}), strategies.ddp(), Mesh(dp=1, tp=2))


def test_uneven_feature_splits_are_allowed_where_no_head_is_cut():
    """torch.chunk semantics: an MLP width of 10 over tp=4 gives rows 3, 3, 3, 1."""
    model = nn.Sequential(nn.Linear(4, 10), nn.Linear(10, 4))
    plan = resolve(model, TensorParallel({"0": ColumnParallel(), "1": RowParallel()}), strategies.zero3(),
                   Mesh(dp=1, tp=4))
    assert plan.params["0.weight"].compute == Spec("tp", None)
    assert plan.params["1.weight"].compute == Spec(None, "tp")
    assert torch.Size(plan.params["0.weight"].shape) == model[0].weight.shape
