"""Ready tensor-parallel plans (Megatron's layout) for the models users bring.

Each is data: ``{module-name pattern: style}`` (``fsdpx.sharding.tensor_parallel``), built from
the model's config because heads must be known to be kept whole. Attention: q/k/v column-parallel
(split by heads), output row-parallel; MLP: up (and gate) column-parallel, down row-parallel;
embedding vocab-parallel; LM head vocab-parallel with the loss on the shards. A tied embedding and
LM head share one layout (rows over ``tp``). Norms, position embeddings and biases of
row-parallel layers stay replicated; a norm applied to each head inside the attention (Qwen3's)
stays replicated too, its gradient summed over ``tp``.

Per block that is two all-reduces of the ``[B, T, C]`` activation forward (attention and MLP
outputs) and two backward (their inputs), Megatron's count. Sequence parallelism (our GPT only:
transformers' GPT-2 and Llama derive positions and masks from the embedding output's length,
which would then be a chunk) turns each into a reduce-scatter or all-gather of the same bytes.
"""

from __future__ import annotations

from typing import Any

from fsdpx.sharding.tensor_parallel import (
    ColumnParallel,
    EnterParallel,
    LocalAttributes,
    ReplicatedOnSplit,
    RowParallel,
    SequenceParallel,
    TensorParallel,
    VocabParallelEmbedding,
)


def gpt_plan(config: Any, axis: str = "tp", *, sequence_parallel: bool = False) -> TensorParallel:
    """The plan of ``fsdpx.models.gpt.GPT`` (fused ``qkv``, tied or untied head). With
    ``sequence_parallel`` the activations between regions are split along the sequence, and
    the position embedding looks up only the rank's positions."""
    styles = {
        "wte": VocabParallelEmbedding(),
        "blocks.*.attn.qkv": ColumnParallel(fused=3, head_dim=config.n_embd // config.n_head),
        "blocks.*.attn.proj": RowParallel(),
        "blocks.*.mlp.fc": ColumnParallel(),
        "blocks.*.mlp.proj": RowParallel(),
        "lm_head": ColumnParallel(vocab=True),
    }
    if sequence_parallel:
        styles["wpe"] = SequenceParallel()
    return TensorParallel(styles, axis, sequence_parallel=sequence_parallel)


def gpt2_plan(config: Any, axis: str = "tp") -> TensorParallel:
    """The plan of transformers' ``GPT2LMHeadModel`` (``Conv1D`` weights stored ``[in, out]``,
    fused ``c_attn``; ``split_size`` counts the features a rank holds)."""
    head_dim = config.n_embd // config.n_head
    return TensorParallel({
        "transformer.wte": VocabParallelEmbedding(),
        "transformer.h.*.attn": LocalAttributes(("split_size",)),
        "transformer.h.*.attn.c_attn": ColumnParallel(fused=3, head_dim=head_dim),
        "transformer.h.*.attn.c_proj": RowParallel(),
        "transformer.h.*.mlp.c_fc": ColumnParallel(),
        "transformer.h.*.mlp.c_proj": RowParallel(),
        "lm_head": ColumnParallel(vocab=True),
    }, axis)


def llama_plan(config: Any, axis: str = "tp") -> TensorParallel:
    """The plan of transformers' ``LlamaForCausalLM``: the attention and MLP inputs enter the
    region once (q/k/v, gate/up share it), grouped-query k/v split by their own heads. Also the
    plan of every family with Llama's module tree (``fsdpx.train.sources.LLAMA_LIKE``: Mistral,
    Qwen2, Gemma 1-2, Cohere, Granite, OLMo...; Qwen2's q/k/v biases split with their rows,
    Gemma's scaled embedding vocabulary-parallel, Gemma-2's logit soft-capping on the shards)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return TensorParallel({
        "model.embed_tokens": VocabParallelEmbedding(),
        "model.layers.*.self_attn": EnterParallel("hidden_states"),
        "model.layers.*.self_attn.q_proj": ColumnParallel(head_dim=head_dim, enter=False),
        "model.layers.*.self_attn.k_proj": ColumnParallel(head_dim=head_dim, enter=False),
        "model.layers.*.self_attn.v_proj": ColumnParallel(head_dim=head_dim, enter=False),
        "model.layers.*.self_attn.o_proj": RowParallel(),
        "model.layers.*.mlp": EnterParallel(0),
        "model.layers.*.mlp.gate_proj": ColumnParallel(enter=False),
        "model.layers.*.mlp.up_proj": ColumnParallel(enter=False),
        "model.layers.*.mlp.down_proj": RowParallel(),
        "lm_head": ColumnParallel(vocab=True),
    }, axis)


def qwen3_plan(config: Any, axis: str = "tp") -> TensorParallel:
    """The plan of transformers' ``Qwen3ForCausalLM``: Llama's, and the per-head query and key
    norms (``q_norm``, ``k_norm``: one ``head_dim`` weight each, shared by every head) replicated,
    each rank normalising its own heads, their gradients summed over ``tp``
    (``ReplicatedOnSplit``). Also Gemma 3's and EXAONE 4's. Not Olmo-2's, whose norms span every
    head at once."""
    styles = dict(llama_plan(config, axis).styles)
    styles["model.layers.*.self_attn.q_norm"] = ReplicatedOnSplit()
    styles["model.layers.*.self_attn.k_norm"] = ReplicatedOnSplit()
    return TensorParallel(styles, axis)


def stablelm_plan(config: Any, axis: str = "tp") -> TensorParallel:
    """The plan of transformers' ``StableLmForCausalLM``: Llama's layout, but its attention
    shapes its heads with its own ``num_heads`` / ``num_key_value_heads``, made local for the
    step (``LocalAttributes``), so q, k and v each enter the region (the module cannot also
    carry the shared entry), as OPT's. Its LayerNorms stay replicated. Not with
    ``qk_layernorm`` (a LayerNorm per head, which would need splitting by heads)."""
    if getattr(config, "qk_layernorm", False):
        raise ValueError("stablelm_plan: qk_layernorm (one LayerNorm per head) is not planned")
    head_dim = config.hidden_size // config.num_attention_heads  # StableLM's own, whatever else the config says
    styles = dict(llama_plan(config, axis).styles)
    styles["model.layers.*.self_attn"] = LocalAttributes(("num_heads", "num_key_value_heads"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        styles[f"model.layers.*.self_attn.{proj}"] = ColumnParallel(head_dim=head_dim)
    return TensorParallel(styles, axis)


def opt_plan(config: Any, axis: str = "tp") -> TensorParallel:
    """The plan of transformers' ``OPTForCausalLM``: q/k/v column-parallel by heads (each
    entering the region: the attention module's own ``num_heads`` is made local, so it cannot
    also carry the shared entry Llama's plan puts there), the feed-forward ``fc1`` column-parallel and ``fc2`` row-parallel on OPT's
    ``[B * T, hidden]`` rows, the embedding vocabulary-parallel and tied to the LM head; the
    learned positions, the norms and ``fc2``'s bias replicated. Not for the checkpoints that
    project the embeddings (``word_embed_proj_dim != hidden_size``: ``project_in`` /
    ``project_out`` would need plans of their own)."""
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        raise ValueError("opt_plan: word_embed_proj_dim != hidden_size (project_in / project_out) is not planned")
    head_dim = config.hidden_size // config.num_attention_heads
    return TensorParallel({
        "model.decoder.embed_tokens": VocabParallelEmbedding(),
        "model.decoder.layers.*.self_attn": LocalAttributes(("num_heads",)),
        "model.decoder.layers.*.self_attn.q_proj": ColumnParallel(head_dim=head_dim),
        "model.decoder.layers.*.self_attn.k_proj": ColumnParallel(head_dim=head_dim),
        "model.decoder.layers.*.self_attn.v_proj": ColumnParallel(head_dim=head_dim),
        "model.decoder.layers.*.self_attn.out_proj": RowParallel(),
        "model.decoder.layers.*.fc1": ColumnParallel(),
        "model.decoder.layers.*.fc2": RowParallel(),
        "lm_head": ColumnParallel(vocab=True),
    }, axis)
