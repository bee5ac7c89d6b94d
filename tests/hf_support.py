"""Tiny transformers models as a user builds them (local configs, nothing downloaded), the losses a
user writes for them, padded batches, and the oracle every per-example result is judged by: a
loop of ``torch.autograd.grad`` on one example at a time, in float64.

The oracle shares no code with ``privacy/``: it never batches two examples, so no batch
broadcasting, mask or tape can leak one example into another's gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

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


def loop_grads(model: nn.Module, params: dict[str, Tensor], batch: tuple[Any, Tensor],
               loss_fn: Callable[[Any, Tensor], Tensor]) -> dict[str, Tensor]:
    """The oracle: ``{name: [B, *shape]}``, example ``i``'s gradient from ``torch.autograd.grad``
    of the model run on example ``i`` alone (a batch of one)."""
    inputs, targets = batch
    names = list(params)
    rows = []
    for i in range(targets.shape[0]):
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        one = {k: v[i:i + 1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[i:i + 1]
        out = functional_call(model, live, (), one) if isinstance(one, dict) else functional_call(model, live, (one,))
        loss = loss_fn(out, targets[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, [live[k] for k in names], allow_unused=True)
        rows.append([torch.zeros_like(live[k]) if g is None else g for k, g in zip(names, grads)])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(names)}


def norms_of(per_example: dict[str, Tensor]) -> Tensor:
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_example.values()))


def clipped_sum_of(per_example: dict[str, Tensor], clip_norm: float) -> dict[str, Tensor]:
    """``sum_i min(1, C / ||g_i||) g_i`` from per-example gradients."""
    c = torch.clamp(clip_norm / norms_of(per_example), max=1.0)
    return {k: torch.einsum("b,b...->...", c, g) for k, g in per_example.items()}


# How close two float64 results must be. transformers runs some parts of a model in float32
# whatever the model's dtype (Llama's RMSNorm upcasts, its eager attention takes the softmax with
# dtype=float32, rotary tables are built in float32). Two computations of the same value that take
# different float32 kernels there (a row padded to T against the row cut to its length; AVX2's
# vector width against AVX-512's, issue 26) may round those values apart by float32's unit
# roundoff U32 relative to them, and the gradients inherit that error relative to their own
# scale, not per element. So a model that computes in float32 is judged to F32_ULPS units of U32
# of the compared tensor's largest entry (measured: 0.02 U32 between AVX2 and AVX-512 kernels on
# Llama's eager softmax; a padding leak or a wrong clip factor is 1e-3 to 1 of the scale); a
# model that is float64 end to end keeps the float64 bound, where only summation order differs.
RTOL, ATOL = 1e-9, 1e-12
U32 = 2.0 ** -24
F32_ULPS = 4


class _Float32Ops(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64:
                self.seen.add(getattr(func, "__name__", repr(func)))
        return out


def float32_ops(model: nn.Module, inputs: Any) -> set[str]:
    """The names of the torch functions a forward of the float64 ``model`` on ``inputs`` runs
    that return a float32 (or narrower) tensor; empty when the model is float64 end to end."""
    recorder = _Float32Ops()
    with torch.no_grad(), recorder:
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return recorder.seen


def assert_close(got: Tensor, want: Tensor, float32_inside: bool, msg: str | None = None) -> None:
    """``got == want`` to the float64 bound, or, when the model computes in float32
    (``float32_ops`` not empty), to ``F32_ULPS * U32`` of ``want``'s largest entry."""
    atol = max(ATOL, F32_ULPS * U32 * want.abs().max().item()) if float32_inside else ATOL
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=msg)
