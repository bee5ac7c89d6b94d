"""Tiny transformers models as a user builds them (local configs, nothing downloaded), the losses a
user writes for them, and padded batches. Results on them are judged by ``support.oracle``
within ``support.tolerance``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, T = 37, 8
PAD = 0


def lm_loss(out: Any, labels: Tensor) -> Tensor:
    """Per-example causal-LM loss ``(B,)`` from a ``CausalLMOutput``: the mean next-token
    cross-entropy over the tokens whose label is not ``-100`` (transformers' ignore index)."""
    logits, y = out.logits[:, :-1], labels[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none", ignore_index=-100)
    return tok.view(y.shape).sum(1) / (y != -100).sum(1).clamp(min=1)


def cls_loss(out: Any, labels: Tensor) -> Tensor:
    """Per-example classification loss ``(B,)`` from a ``SequenceClassifierOutput``."""
    return F.cross_entropy(out.logits, labels, reduction="none")


def gpt2(attn: str = "eager", dropout: float = 0.0) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=12, n_layer=2, n_head=2,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, use_cache=False,
                                     attn_implementation=attn)
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def llama(attn: str = "sdpa", tied: bool = False) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * T,
                                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
                                      use_cache=False, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).double()


def bert(attn: str = "eager") -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=2 * T, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD,
                                     attn_implementation=attn)
    return transformers.BertForSequenceClassification(config).double()


def causal_lm(family: str, dropout: float = 0.0) -> nn.Module:
    """A tiny causal LM of another transformers family, as a user builds it (eager attention,
    float64): ``"phi3"`` (Llama's RMSNorm code under another name), ``"gemma"`` (scaled
    embedding tied to the LM head, ``1 + weight`` RMSNorm), ``"falcon"`` (``FalconLinear``),
    ``"olmo2"`` (the scale applied before the cast, query/key norms), ``"opt"`` (its
    feed-forward block on ``[B * T, hidden]`` rows, a learned positional embedding)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, use_cache=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                  attn_implementation="eager")
    llama_like = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2 * T)
    configs = {
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(llama_like, attention_dropout=dropout)),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(llama_like, head_dim=4)),
        "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM,
                   dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=dropout)),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, llama_like),
        "opt": (transformers.OPTConfig, transformers.OPTForCausalLM,
                dict(hidden_size=16, ffn_dim=24, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * T,
                     word_embed_proj_dim=16, dropout=dropout)),
    }
    config_cls, model_cls, sizes = configs[family]
    return model_cls(config_cls(**common, **sizes)).double()


def padded_batch(lengths: list[int], *, causal: bool, seed: int = 1) -> tuple[dict[str, Tensor], Tensor]:
    """``({"input_ids", "attention_mask"}, labels)`` of right-padded sequences of the given
    lengths, padded to ``T``: pads have mask 0 and (causal) label ``-100``; a classifier gets
    one label in ``[0, 3)`` per example."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    labels = ids.masked_fill(mask == 0, -100) if causal else torch.randint(0, 3, (len(lengths),), generator=g)
    return {"input_ids": ids, "attention_mask": mask}, labels


def unpadded(inputs: dict[str, Tensor], labels: Tensor, i: int, length: int) -> tuple[dict[str, Tensor], Tensor]:
    """Example ``i`` alone, cut to its first ``length`` tokens (no padding at all)."""
    cut = {k: v[i:i + 1, :length] for k, v in inputs.items()}
    return cut, (labels[i:i + 1, :length] if labels.dim() == 2 else labels[i:i + 1])
