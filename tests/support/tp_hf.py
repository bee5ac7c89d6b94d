"""transformers' own causal LMs under tensor parallelism, unmodified (tiny configs built here,
nothing downloaded, float64): models whose heads split over ``tp = 2``, the loss a user writes
for them, and the check that sharded steps of them equal the unsharded steps.

The vocabulary (37) does not divide by ``tp`` (ranks hold 19 and 18 rows). Used as
``from support import tp_hf`` and ``tp_hf.check(...)``: its names are generic without the module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.sharding import strategies
from fsdpx.sharding.tensor_parallel import resolve
from privacy.step import DPConfig, init_state, make_private_step

from support.mesh_runs import tensor_parallel_run
from support.reference import assert_close_to_reference, optimizer_for

VOCAB, T, B = 37, 8, 4
TOL = 1e-10
NUM_EXAMPLES = 50


def hf_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Per-example loss ``(B,)`` from a transformers ``CausalLMOutput``, as a user writes it."""
    logits = out.logits
    b, t, v = logits.shape
    return F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t), reduction="none").view(b, t).mean(1)


def gpt2(attn: str):
    """transformers' ``GPT2LMHeadModel``, unmodified, float64: 4 heads of width 4, 2 layers, no
    dropout, ``lm_head`` tied to ``wte``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                                     bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation=attn)
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def llama(attn: str, tied: bool = False, pad: int | None = None):
    """transformers' ``LlamaForCausalLM``, unmodified, float64: 4 heads, 2 k/v heads (one per rank
    at tp=2), 2 layers; ``lm_head`` tied to ``embed_tokens`` when ``tied``; ``pad`` its
    ``pad_token_id``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=24, num_hidden_layers=2,
                                      max_position_embeddings=T, bos_token_id=0, eos_token_id=0, pad_token_id=pad,
                                      tie_word_embeddings=tied, use_cache=False, attn_implementation=attn)
    model = transformers.LlamaForCausalLM(config).double()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def family(family: str, **config):
    """transformers' ``{family}ForCausalLM``, unmodified, from one tiny config (4 heads, 2 k/v
    heads, head_dim 4, ``config`` over it), float64. Per-head query/key norms start at ones;
    they are moved off them, so a rank's share of their gradient differs from the whole."""
    import transformers

    cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    model = cls(cls.config_class(**{**dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=4, intermediate_size=24,
                                           num_hidden_layers=2, max_position_embeddings=T, bos_token_id=0,
                                           eos_token_id=0, pad_token_id=0, use_cache=False,
                                           attn_implementation="eager"), **config})).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model


def qwen3(tied: bool = False):
    """transformers' ``Qwen3ForCausalLM`` of ``family``'s config, its per-head norms moved off ones."""
    return family("Qwen3", tie_word_embeddings=tied)


def batches():
    """Two batches of ``B`` random token sequences of length ``T`` (inputs, targets), seed 1."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g))
            for _ in range(2)]


def dp_config(method: str) -> DPConfig:
    """``support.reference.dp_config``'s knobs, with the clipping method."""
    return DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method=method)


def reference(model, batches, optimizer, config, trainable):
    """The unsharded steps (plain or private, key 7); parameters outside ``trainable`` frozen."""
    params = {k: p for k, p in model.named_parameters() if k in trainable}
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, hf_loss, optimizer)
    else:
        state = init_state(params, optimizer, key=7, config=config)
        step = make_private_step(model, hf_loss, optimizer, config, num_examples=NUM_EXAMPLES)
    for b in batches:
        state, _ = step(state, b)
    return state.params


def check(model, tp_plan, mesh, config, frozen=(), tol=TOL):
    """Asserts that two AdamW steps of ``model`` under ``tp_plan`` over ZeRO-3 on the simulated
    ``mesh`` (``frozen`` parameters left out) give the parameters of two unsharded steps within
    ``tol`` (``support.reference.assert_close_to_reference``), plain or private (``config``), and
    that every rank reports the same loss."""
    trainable = [n for n, _ in model.named_parameters() if n not in frozen]
    plan = resolve(model, tp_plan, strategies.zero3(), mesh, trainable=trainable)
    assert set(plan.params) == set(trainable)
    steps = batches()
    optimizer = optimizer_for(torch.float64)
    ref = reference(model, steps, optimizer, config, trainable)
    got, metrics = tensor_parallel_run(model, steps, optimizer, config, plan, mesh, loss_fn=hf_loss,
                                       trainable=trainable)
    assert_close_to_reference(got, ref, model, tol)
    assert len({m["loss"] for m in metrics}) == 1  # every rank reports the same loss
