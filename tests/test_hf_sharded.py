"""transformers models, unmodified, through every sharding strategy (issue 14, section 1).

The batches are what a user hands a transformers model: a mapping of keyword arguments
(``{"input_ids", "attention_mask"}``, right padding, ``-100`` labels on pads for the causal
LMs), a tuple with ``None`` entries (positional arguments left at their default), and a shared
``[1, T]`` ``position_ids`` that leads with 1, not the batch. Each runs N steps on the simulated
mesh (``fsdpx.run_threads``) under DDP, ZeRO-2, ZeRO-3 and HSDP, private (ghost clipping) and
plain, and must equal N unsharded steps (``make_private_step`` / ``make_plain_step``) in float64
to rel 1e-9 (judged as ``property_tests/test_sharded_properties.py`` judges: relative to the
larger of a parameter's size and the largest update). Then one tensor-parallel case (GPT-2,
``gpt2_plan``) and one pipelined case (Llama, two stages). The real gloo run of BERT under
private ZeRO-3 is ``tests/multiprocess/test_hf_gloo.py``.
"""

from __future__ import annotations

import pytest
import torch

from fsdpx.models.tp_plans import gpt2_plan
from fsdpx.sharding import Mesh, strategies
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
from fsdpx.sharding.tensor_parallel import resolve
from privacy.step import DPConfig

from support import hf_sharded
from support.reference import assert_close_to_reference, optimizer_for

pytest.importorskip("transformers")
from support.hf import bert, cls_loss, gpt2, llama, lm_loss, padded_batch  # noqa: E402

MODELS = {"bert": (bert, cls_loss, False), "gpt2": (gpt2, lm_loss, True), "llama": (llama, lm_loss, True)}
STRATEGIES = {
    "ddp": (strategies.ddp, Mesh(dp=2)),
    "zero2": (strategies.zero2, Mesh(dp=2)),
    "zero3": (strategies.zero3, Mesh(dp=2)),
    "hsdp": (strategies.hsdp, Mesh(replica=2, shard=2)),
}


def _check(name, strategy, mesh, private, form="mapping"):
    build, loss_fn, causal = MODELS[name]
    model = build()
    batches = hf_sharded.batches(causal, form)
    optimizer = optimizer_for(torch.float64)
    config = hf_sharded.dp_config() if private else None
    ref, ref_losses = hf_sharded.reference(model, loss_fn, batches, optimizer, config)
    got, metrics = hf_sharded.sharded_run(model, loss_fn, batches, optimizer, config, strategy, mesh)
    assert_close_to_reference(got, ref, model, hf_sharded.TOL)
    for per_rank in metrics:  # every rank reports the unsharded step's loss and batch size
        for i, m in enumerate(per_rank):
            assert m["loss"] == pytest.approx(ref_losses[i], rel=1e-12)
            assert m["batch_size"] == len(hf_sharded.LENGTHS[i])


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_with_mapping_inputs_equals_the_unsharded_run(name, strategy, private):
    """``model(**{"input_ids", "attention_mask"})`` with right padding: BERT classifies, GPT-2
    (tied ``wte``/``lm_head``, ``Conv1D``) and Llama (RMSNorm, rotary) predict tokens with
    ``-100`` on the pads."""
    make, mesh = STRATEGIES[strategy]
    _check(name, make(), mesh, private)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_bert_with_positional_inputs_holding_none_and_a_shared_tensor(private):
    """``model(input_ids, attention_mask, None, position_ids)``: the ``None`` (token types left
    at their default) and the ``[1, T]`` position ids are shared by every rank, the rest split."""
    _check("bert", strategies.zero3(), Mesh(dp=2), private, form="tuple")


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_gpt2_tensor_parallel_with_attention_mask_and_ignored_labels(private):
    """``gpt2_plan`` over ``Mesh(dp=2, tp=2)`` under ZeRO-3: heads and the MLP split over ``tp``,
    the vocabulary-parallel cross-entropy skips ``-100`` labels, the mask reaches every rank."""
    model = gpt2()
    mesh = Mesh(dp=2, tp=2)
    plan = resolve(model, gpt2_plan(model.config), strategies.zero3(), mesh)
    hf_sharded.check_plan(model, lm_loss, plan, mesh, private, causal=True)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_llama_pipelined_with_attention_mask_and_ignored_labels(private):
    """Two stages (one Llama block each), 1F1B over two microbatches, ZeRO-3 over ``dp=2``: the
    first stage gets the mapping; the later stage runs the model's forward on the same mapping
    (its causal mask from ``attention_mask``) with the received hidden state injected."""
    model = llama()
    mesh = Mesh(dp=2, pp=2)
    base = resolve(model, None, strategies.zero3(), mesh)
    plan = resolve_pipeline(model, base, PipelineParallel(schedule="1f1b", microbatches=2), mesh)
    config = DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="auto") if private else None
    hf_sharded.check_plan(model, lm_loss, plan, mesh, private, causal=True, config=config)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_bert_padded_poisson_batches_equal_the_unpadded_run(private):
    """Fixed-shape batches (``privacy.padding.pad_batch``) of a mapping data set under ZeRO-3
    over ``dp=3``: padding rows (copies of row 0, mask False) change nothing; with 3 and 5 real
    examples padded to 7, a rank may hold only padding."""
    from privacy.padding import pad_batch

    model = bert()
    inputs, labels = padded_batch([5, 8, 3, 6, 2, 7, 4, 1], causal=False, seed=3)
    picks = [torch.tensor([1, 4, 6]), torch.tensor([0, 2, 3, 5, 7])]
    plain = [({k: v[i] for k, v in inputs.items()}, labels[i]) for i in picks]
    padded = [pad_batch((inputs, labels), i, 7) for i in picks]
    assert {b[1].shape[0] for b in padded} == {7}
    optimizer = optimizer_for(torch.float64)
    config = hf_sharded.dp_config() if private else None
    ref, ref_losses = hf_sharded.reference(model, cls_loss, plain, optimizer, config)
    got, metrics = hf_sharded.sharded_run(model, cls_loss, padded, optimizer, config, strategies.zero3(), Mesh(dp=3))
    assert_close_to_reference(got, ref, model, hf_sharded.TOL)
    for per_rank in metrics:
        assert [m["batch_size"] for m in per_rank] == [3, 5]
        assert [m["loss"] for m in per_rank] == pytest.approx(ref_losses, rel=1e-12)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_llama_pipelined_padded_batches_equal_the_unpadded_run(private):
    """The mask travels with each microbatch: Llama on two stages (1F1B, 3 microbatches),
    batches of 3 and 5 real examples padded to 6, equal the unpadded unsharded run."""
    from privacy.padding import pad_batch

    model = llama()
    inputs, labels = padded_batch([5, 8, 3, 6, 2, 7, 4, 1], causal=True, seed=4)
    picks = [torch.tensor([1, 4, 6]), torch.tensor([0, 2, 3, 5, 7])]
    plain = [({k: v[i] for k, v in inputs.items()}, labels[i]) for i in picks]
    padded = [pad_batch((inputs, labels), i, 6) for i in picks]
    mesh = Mesh(dp=1, pp=2)
    plan = resolve_pipeline(model, resolve(model, None, strategies.zero3(), mesh),
                            PipelineParallel(schedule="1f1b", microbatches=3), mesh)
    optimizer = optimizer_for(torch.float64)
    config = DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="auto") if private else None
    ref, ref_losses = hf_sharded.reference(model, lm_loss, plain, optimizer, config)
    got, metrics = hf_sharded.sharded_run(model, lm_loss, padded, optimizer, config, plan, mesh)
    assert_close_to_reference(got, ref, model, hf_sharded.TOL)
    last = metrics[-1]  # the last stage's rank reports the loss
    assert [m["batch_size"] for m in last] == [3, 5]
    assert [m["loss"] for m in last] == pytest.approx(ref_losses, rel=1e-12)
