"""transformers families beyond GPT-2, Llama and BERT, unmodified, through the privacy methods.

Phi-3 (an RMSNorm with Llama's code under its own name), Gemma (a scaled word embedding tied
to the LM head, a ``1 + weight`` RMSNorm computed in float32), Falcon (``FalconLinear``),
Olmo-2 (the RMSNorm's scale applied before its cast, query and key norms) get their ghost
rules from ``privacy.layers.same_code_rule``: a class whose code is a reference's. OPT runs its
feed-forward block on the examples' rows flattened together (``[B * T, hidden]``), which the
tape accepts once the rows are proven to be the examples' (``privacy/example_rows.py``); its
learned positional embedding has no rule, so OPT runs under ``method="auto"`` (a vmap for that
module alone). Every per-example norm and clipped sum is judged against the oracle of
``support.oracle.loop_grads`` (one example at a time, plain autograd, float64), with padding.
"""

from __future__ import annotations

import pytest
import torch

from support.hf import causal_lm, lm_loss, padded_batch
from support.oracle import clipped_sum_of, loop_grads, norms_of
from support.tolerance import assert_close, float32_ops
from privacy import clipped_grad, per_sample_norms
from privacy.errors import UnsupportedLayerError
from privacy.layers import gemma_rms_norm, linear, llama_rms_norm, rule_for, scale_then_cast_rms_norm, scaled_embedding

pytest.importorskip("transformers")

LENGTHS = [5, 8, 3]
CLIP = 0.5
METHODS = {"phi3": ("ghost", "vmap"), "gemma": ("ghost", "vmap"), "falcon": ("ghost", "vmap"),
           "olmo2": ("ghost", "vmap"), "opt": ("auto", "vmap")}


@pytest.fixture(scope="module", params=list(METHODS))
def case(request):
    model = causal_lm(request.param).eval()
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=True)
    f32 = bool(float32_ops(model, batch[0]))  # their norms or softmax upcast; OPT's softmax too
    return request.param, model, params, batch, loop_grads(model, params, batch, lm_loss), f32


def test_per_example_norms_and_clipped_sums_equal_a_per_example_autograd_loop(case):
    family, model, params, batch, oracle, f32 = case
    want = clipped_sum_of(oracle, CLIP)
    for method in METHODS[family]:
        norms = per_sample_norms(model, params, batch, lm_loss, method=method)
        assert_close(norms, norms_of(oracle), f32, msg=method)
        grads, _ = clipped_grad(model, params, batch, lm_loss, clip_norm=CLIP, method=method)
        for name in params:
            assert_close(grads[name], want[name], f32, msg=f"{method} {name}")


def test_each_family_gets_its_rules_from_the_reference_code():
    """The rule each family's layers get: the reference whose code theirs is."""
    want = {"phi3": {"Phi3RMSNorm": llama_rms_norm},
            "gemma": {"GemmaRMSNorm": gemma_rms_norm, "GemmaTextScaledWordEmbedding": scaled_embedding},
            "falcon": {"FalconLinear": linear},
            "olmo2": {"Olmo2RMSNorm": scale_then_cast_rms_norm}}
    for family, rules in want.items():
        modules = {type(m).__name__: m for m in causal_lm(family).modules()}
        for cls, rule in rules.items():
            assert rule_for(modules[cls]) is rule, (family, cls)


def test_opt_under_ghost_names_its_positional_embedding_and_runs_the_rest_on_example_rows():
    """``method="ghost"`` stops at the one module without a rule (the flattened feed-forward
    block is not what stops it)."""
    model = causal_lm("opt").eval()
    params = dict(model.named_parameters())
    with pytest.raises(UnsupportedLayerError, match="embed_positions"):
        per_sample_norms(model, params, padded_batch(LENGTHS, causal=True), lm_loss, method="ghost")
    frozen = {k: v for k, v in params.items() if "embed_positions" not in k}
    batch = padded_batch(LENGTHS, causal=True)
    f32 = bool(float32_ops(model, batch[0]))
    oracle = loop_grads(model, frozen, batch, lm_loss)
    assert_close(per_sample_norms(model, frozen, batch, lm_loss, method="ghost"), norms_of(oracle), f32)


@pytest.mark.parametrize("family", ["opt", "phi3"])
def test_dropout_in_training_mode_matches_the_oracle_under_the_same_seed(family):
    """Training mode with dropout: the tape's run and the oracle's loop draw different masks,
    so the comparison is one example at a time, each run seeded alike (batch of one)."""
    model = causal_lm(family, dropout=0.3).train()
    params = dict(model.named_parameters())
    inputs, labels = padded_batch(LENGTHS, causal=True)
    f32 = bool(float32_ops(model, inputs))
    method = METHODS[family][0]
    for i in range(len(LENGTHS)):
        one = ({k: v[i:i + 1] for k, v in inputs.items()}, labels[i:i + 1])
        torch.manual_seed(7)
        got = per_sample_norms(model, params, one, lm_loss, method=method)
        torch.manual_seed(7)
        want = norms_of(loop_grads(model, params, one, lm_loss))
        assert_close(got, want, f32)


def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)  # Llama's code, reformatted comments aside


def _changed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (1 + self.weight) * hidden_states.to(input_dtype)


def test_a_class_gets_a_rule_by_its_code_not_its_name():
    """A transformers class named like Llama's norm whose forward differs gets no rule; one
    under any name whose forward is Llama's code (comments aside) gets Llama's."""
    from torch import nn

    from privacy.layers import same_code_rule

    where = "transformers.models.fake.modeling_fake"
    copy = type("SomeRMSNorm", (nn.Module,), {"forward": _llama_forward, "__module__": where})
    changed = type("LlamaRMSNorm", (nn.Module,), {"forward": _changed_forward, "__module__": where})
    other_base = type("OtherRMSNorm", (nn.Linear,), {"forward": _llama_forward, "__module__": where})
    assert same_code_rule(copy) is llama_rms_norm
    assert same_code_rule(changed) is None
    assert same_code_rule(other_base) is None


def test_bart_scaled_embedding_with_a_number_as_its_scale():
    """BART's ``BartScaledWordEmbedding`` (``embed_scale`` a float, where Gemma's is a tensor)
    under the same rule: a lookup, a padding row, a head; ghost == the per-example loop."""
    from torch import nn
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = BartScaledWordEmbedding(11, 4, padding_idx=0, embed_scale=2.0)
            self.head = nn.Linear(4, 11)

        def forward(self, ids):
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    model = Tiny().double()
    assert rule_for(model.embed) is scaled_embedding
    params = dict(model.named_parameters())
    ids = torch.tensor([[1, 2, 0, 0], [3, 3, 4, 0], [5, 0, 0, 0]])

    def loss(out, targets):
        return torch.nn.functional.cross_entropy(out.transpose(1, 2), targets, reduction="none").mean(1)

    batch = (ids, ids.roll(1, 1))
    f32 = bool(float32_ops(model, ids))
    oracle = loop_grads(model, params, batch, loss)
    assert_close(per_sample_norms(model, params, batch, loss, method="ghost"), norms_of(oracle), f32)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_activation_checkpointing_under_ghost_matches_the_loop_and_vmap_says_why_it_cannot(family):
    """``gradient_checkpointing_enable()`` (recomputing each layer in the backward): ghost
    clipping's one forward and one backward are unaffected, its norms and clipped sums equal the
    per-example loop; ``method="vmap"`` is refused naming the cause (torch.func cannot run
    through ``torch.utils.checkpoint``) instead of torch's own error from inside the transform."""
    from support.hf import gpt2, llama
    from privacy.errors import PrivacyError

    model = (llama("eager") if family == "llama" else gpt2("eager"))
    model.gradient_checkpointing_enable()
    model.train()
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=True)
    model.gradient_checkpointing_disable()
    f32 = bool(float32_ops(model, batch[0]))
    oracle = loop_grads(model, params, batch, lm_loss)
    model.gradient_checkpointing_enable()
    grads, norms = clipped_grad(model, params, batch, lm_loss, clip_norm=CLIP, method="ghost")
    assert_close(norms, norms_of(oracle), f32)
    want = clipped_sum_of(oracle, CLIP)
    for name in params:
        assert_close(grads[name], want[name], f32, msg=name)
    with pytest.raises(PrivacyError, match="activation checkpointing"):
        per_sample_norms(model, params, batch, lm_loss, method="vmap")


def _deberta():
    import transformers

    from support.hf import PAD, VOCAB

    torch.manual_seed(0)
    config = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=24, max_position_embeddings=32, num_labels=3, pad_token_id=PAD,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                          relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
                                          attn_implementation="eager")
    return transformers.DebertaV2ForSequenceClassification(config).double().eval()


def test_deberta_under_ghost_names_the_shared_call_it_cannot_follow():
    """DeBERTa-v2 projects its relative embeddings (shared by every example) and repeats them
    per head: the tape's expansion of that shared output to the batch breaks the model's
    shapes. Ghost clipping says so, naming the call and pointing to vmap, which is exact."""
    from support.hf import cls_loss
    from privacy.errors import PerExampleError

    model = _deberta()
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=False)
    f32 = bool(float32_ops(model, batch[0]))
    with pytest.raises(PerExampleError, match=r"'deberta\.encoder\.layer\.0\.attention\.self\.pos_.*_proj'.*method='vmap'"):
        per_sample_norms(model, params, batch, cls_loss, method="ghost")
    assert_close(per_sample_norms(model, params, batch, cls_loss, method="vmap"),
                 norms_of(loop_grads(model, params, batch, cls_loss)), f32)


@pytest.mark.parametrize("family", ["roberta", "electra", "albert", "distilbert"])
def test_encoder_classifiers_under_ghost_equal_the_loop(family):
    """Encoders users fine-tune privately: RoBERTa (padding-aware positions), ELECTRA (a projected
    embedding), ALBERT (one layer's weights shared by every layer: its calls add up), DistilBERT."""
    import transformers

    from support.hf import PAD, VOCAB, cls_loss

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_labels=3, pad_token_id=PAD, max_position_embeddings=32, attn_implementation="eager")
    bert_like = dict(common, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config, model_cls = {
        "roberta": (lambda: transformers.RobertaConfig(**bert_like), transformers.RobertaForSequenceClassification),
        "electra": (lambda: transformers.ElectraConfig(**bert_like, embedding_size=8),
                    transformers.ElectraForSequenceClassification),
        "albert": (lambda: transformers.AlbertConfig(**bert_like, embedding_size=8, classifier_dropout_prob=0.0),
                   transformers.AlbertForSequenceClassification),
        "distilbert": (lambda: transformers.DistilBertConfig(**common, dim=16, n_layers=2, n_heads=2, hidden_dim=24,
                                                             dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0),
                       transformers.DistilBertForSequenceClassification),
    }[family]
    model = model_cls(config()).double().eval()
    params = dict(model.named_parameters())
    batch = padded_batch(LENGTHS, causal=False)
    f32 = bool(float32_ops(model, batch[0]))
    oracle = loop_grads(model, params, batch, cls_loss)
    grads, norms = clipped_grad(model, params, batch, cls_loss, clip_norm=CLIP, method="ghost")
    assert_close(norms, norms_of(oracle), f32)
    want = clipped_sum_of(oracle, CLIP)
    for name in params:
        assert_close(grads[name], want[name], f32, msg=name)
