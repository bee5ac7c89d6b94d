"""Tensor parallelism on transformers' own models, unmodified: ``GPT2LMHeadModel`` under
``gpt2_plan`` and ``LlamaForCausalLM`` under ``llama_plan`` (tiny configs built here, nothing
downloaded), on the simulated mesh, equal the unsharded run.

Two AdamW steps of ``make_sharded_step`` with ZeRO-3 over ``dp`` and Megatron tensor parallelism
over ``tp`` (``Mesh(dp=1, tp=2)``, ``Mesh(dp=2, tp=2)``) give the parameters of two unsharded
steps, plain and private (same key), float64 to rel 1e-10, judged as
``support.reference.assert_close_to_reference`` judges them (``support.tp_hf.check``). The
vocabulary (37) does not divide by ``tp`` (ranks hold 19 and 18 rows); GPT-2 ties its LM head to
``wte``; Llama's attention is grouped-query (4 heads, 2 k/v heads: one k/v head per rank).

The loss is what a user writes for a Hugging Face causal LM: the per-example mean of
``F.cross_entropy`` on ``out.logits`` (the model's own output object), unchanged under tensor
parallelism, where the logits are vocabulary-sharded.
"""

from __future__ import annotations

import pytest
import torch

from fsdpx.models.tp_plans import gpt2_plan, llama_plan
from fsdpx.sharding import Mesh
from fsdpx.train.parallel import LLAMA_LIKE, PER_HEAD_NORMS, TP_PLANS

from support import tp_hf

transformers = pytest.importorskip("transformers")

MESHES = {"dp1_tp2": Mesh(dp=1, tp=2), "dp2_tp2": Mesh(dp=2, tp=2)}


@pytest.mark.parametrize("mesh, attn", [("dp1_tp2", "eager"), ("dp2_tp2", "sdpa")])
def test_hf_gpt2_tensor_parallel_steps_equal_unsharded_steps(mesh, attn):
    model = tp_hf.gpt2(attn)
    tp_hf.check(model, gpt2_plan(model.config), MESHES[mesh], None)


@pytest.mark.parametrize("mesh, attn", [("dp1_tp2", "sdpa"), ("dp2_tp2", "eager")])
def test_hf_gpt2_private_tensor_parallel_steps_equal_unsharded_steps(mesh, attn):
    """Ghost clipping (every GPT-2 layer has a rule), everything trains: ``GPT2Model`` looks ``wpe``
    up with positions ``[1, T]`` broadcast over the batch, which the tape expands to the batch
    (``privacy.tape.record``), sharded or not."""
    model = tp_hf.gpt2(attn)
    tp_hf.check(model, gpt2_plan(model.config), MESHES[mesh], tp_hf.dp_config("ghost"))


@pytest.mark.parametrize("mesh, attn, tied", [("dp1_tp2", "eager", False), ("dp2_tp2", "sdpa", False),
                                              ("dp2_tp2", "sdpa", True)])
def test_hf_llama_tensor_parallel_steps_equal_unsharded_steps(mesh, attn, tied):
    model = tp_hf.llama(attn, tied)
    tp_hf.check(model, llama_plan(model.config), MESHES[mesh], None)


@pytest.mark.parametrize("mesh, attn, tied", [("dp1_tp2", "sdpa", False), ("dp2_tp2", "eager", False),
                                              ("dp2_tp2", "sdpa", True)])
def test_hf_llama_private_tensor_parallel_steps_equal_unsharded_steps(mesh, attn, tied):
    """``method="auto"``, the default: every layer has a ghost rule (``LlamaRMSNorm`` by its code,
    its weight replicated over ``tp``), so the whole model is ghost-clipped."""
    model = tp_hf.llama(attn, tied)
    tp_hf.check(model, llama_plan(model.config), MESHES[mesh], tp_hf.dp_config("auto"))


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("pad", [0, 20])
def test_hf_llama_private_tensor_parallel_with_a_padding_token(pad, private):
    """``pad_token_id`` set: ``embed_tokens`` has a ``padding_idx``, whose row gets no gradient.
    Rank 0 holds rows 0-18, rank 1 rows 19-36, so the padding row is rank 0's (0) or rank 1's
    (20, local row 1). The runtime makes ``padding_idx`` local for the call; the ghost rule
    reads it as it was during the call (``privacy.ghost.as_called``). Before, it read the
    global index: rank 1 dropped token 19's contributions (pad 0) or gave the padding row
    contributions (pad 20), so norms and clipped sums were wrong."""
    model = tp_hf.llama("eager", pad=pad)
    assert model.model.embed_tokens.padding_idx == pad
    tp_hf.check(model, llama_plan(model.config), MESHES["dp1_tp2"], tp_hf.dp_config("ghost") if private else None)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_plan_runs_gemma_unmodified(tied, private):
    """Gemma's module tree is Llama's; its embedding is scaled (``GemmaTextScaledWordEmbedding``,
    vocabulary-parallel as any embedding) and tied to the LM head by default. Its RMSNorms
    compute in float32 inside the float64 model, so their gradients carry float32 rounding,
    which sharding sums in another order: equal to the unsharded steps within rel 1e-5 (the
    other parameters as tightly as Llama's)."""
    from fsdpx.train.parallel import TP_PLANS

    assert TP_PLANS["GemmaForCausalLM"] is llama_plan
    model = tp_hf.family("Gemma", tie_word_embeddings=tied)
    tp_hf.check(model, llama_plan(model.config), MESHES["dp2_tp2"], tp_hf.dp_config("ghost") if private else None,
                tol=1e-5)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("mesh", ["dp1_tp2", "dp2_tp2"])
def test_opt_plan_runs_opt_unmodified(mesh, private):
    """``opt_plan`` on transformers' OPT (tied head, learned positions, its feed-forward on
    ``[B * T, hidden]`` rows): equal to the unsharded steps. Private under ``method="auto"``:
    ``fc1``'s input is the region's entry of a flattened view, which the tape proves to be the
    examples' rows through the entry's ``preserves_rows`` (``privacy/example_rows.py``)."""
    from fsdpx.models.tp_plans import opt_plan
    from fsdpx.train.parallel import TP_PLANS

    assert TP_PLANS["OPTForCausalLM"] is opt_plan
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=tp_hf.VOCAB, hidden_size=16, ffn_dim=24, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=tp_hf.T, word_embed_proj_dim=16,
                                    dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
                                    attn_implementation="eager")
    model = transformers.OPTForCausalLM(config).double()
    tp_hf.check(model, opt_plan(model.config), MESHES[mesh], tp_hf.dp_config("auto") if private else None)
    with pytest.raises(ValueError, match="word_embed_proj_dim"):
        opt_plan(transformers.OPTConfig(hidden_size=16, word_embed_proj_dim=8, num_attention_heads=4))


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("mesh, tied", [("dp1_tp2", False), ("dp2_tp2", True)])
def test_qwen3_plan_runs_qwen3_unmodified(mesh, tied, private):
    """Qwen3 normalises each head's queries and keys with one ``head_dim`` weight shared by
    every head; a rank normalises its own heads, so its gradient of that weight is its heads'
    share. ``qwen3_plan`` marks the norms ``ReplicatedOnSplit`` and the step sums the share over
    ``tp`` (private: each example's, before its norm): equal to the unsharded steps."""
    from fsdpx.models.tp_plans import qwen3_plan
    from fsdpx.train.parallel import TP_PLANS

    assert TP_PLANS["Qwen3ForCausalLM"] is qwen3_plan
    model = tp_hf.qwen3(tied)
    tp_hf.check(model, qwen3_plan(model.config), MESHES[mesh], tp_hf.dp_config("ghost") if private else None)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("mesh", ["dp1_tp2", "dp2_tp2"])
def test_qwen3_per_head_norms_without_their_style_are_refused(mesh, private):
    """What ``ReplicatedOnSplit`` is for: under Llama's plan each rank's gradient of a per-head
    norm is only its heads' share. The first step compares the tp-replicated gradients across
    the ``tp`` ranks before any update (``fsdpx.runtime.replicas``) and refuses, naming every
    per-head norm and no other parameter."""
    from fsdpx.sharding.tensor_parallel import TensorParallelPlanError

    model = tp_hf.qwen3()
    norms = sorted(n for n, _ in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    with pytest.raises(TensorParallelPlanError, match="ReplicatedOnSplit") as e:
        tp_hf.check(model, llama_plan(model.config), MESHES[mesh], tp_hf.dp_config("ghost") if private else None)
    assert str(norms) in str(e.value)


# families whose norms compute in float32 inside the float64 model: rounding summed in another
# order under sharding (as Gemma's, above)
FLOAT32_NORMS = {"Gemma", "Gemma2", "Gemma3", "VaultGemma", "Helium", "Cohere", "Cohere2"}


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
@pytest.mark.parametrize("family", sorted(LLAMA_LIKE + PER_HEAD_NORMS + ("StableLm",)))
def test_every_planned_family_equals_the_unsharded_run(family, private):
    """Every transformers family ``fsdpx train --tp`` plans by class name (``TP_PLANS``), built
    unmodified from one tiny config (4 heads, 2 k/v heads, head_dim 4, per-head norms moved off
    ones), at dp=2 x tp=2 under ZeRO-3: two steps equal the unsharded ones, plain and private
    (``method="auto"``), float64 to rel 1e-10 (1e-5 where the norms compute in float32)."""
    model = tp_hf.family(family)
    tol = 1e-5 if family in FLOAT32_NORMS else tp_hf.TOL
    tp_hf.check(model, TP_PLANS[f"{family}ForCausalLM"](model.config), MESHES["dp2_tp2"],
                tp_hf.dp_config("auto") if private else None, tol=tol)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_stablelm_plan_with_qkv_biases_and_a_parallel_residual(private):
    """StableLM's options beside the defaults above: q/k/v biases split with their rows, the
    attention and MLP on one normed input (``use_parallel_residual``); its per-head LayerNorms
    (``qk_layernorm``) are refused by name."""
    from fsdpx.models.tp_plans import stablelm_plan

    torch.manual_seed(0)
    config = transformers.StableLmConfig(vocab_size=tp_hf.VOCAB, hidden_size=16, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=24, num_hidden_layers=2,
                                         max_position_embeddings=tp_hf.T, bos_token_id=0, eos_token_id=0,
                                         pad_token_id=0, use_cache=False, attn_implementation="eager",
                                         use_qkv_bias=True, use_parallel_residual=True)
    model = transformers.StableLmForCausalLM(config).double()
    assert TP_PLANS["StableLmForCausalLM"] is stablelm_plan
    tp_hf.check(model, stablelm_plan(model.config), MESHES["dp2_tp2"], tp_hf.dp_config("auto") if private else None)
    with pytest.raises(ValueError, match="qk_layernorm"):
        stablelm_plan(transformers.StableLmConfig(hidden_size=16, num_attention_heads=4, qk_layernorm=True))


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_dropout_under_tensor_parallelism_is_refused_by_name(private):
    """GPT-2's default dropout (0.1): each tensor-parallel rank draws its own masks, so the
    activations the plan keeps whole differ between ranks and the replicas would train apart.
    The first step refuses before any update, naming the dropout modules and how to turn them
    off; with them off the same model trains (the GPT-2 tests above)."""
    from fsdpx.sharding.tensor_parallel import TensorParallelPlanError

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tp_hf.VOCAB, n_positions=tp_hf.T, n_embd=16, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.training and config.resid_pdrop > 0
    with pytest.raises(TensorParallelPlanError, match="dropout active") as e:
        tp_hf.check(model, gpt2_plan(model.config), MESHES["dp1_tp2"], tp_hf.dp_config("ghost") if private else None)
    assert "transformer.drop" in str(e.value) and "resid_pdrop = 0.0" in str(e.value)
