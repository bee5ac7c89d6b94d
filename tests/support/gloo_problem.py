"""The fixed problem the multi-process tests (``tests/multiprocess/``) train: a tiny GPT (uneven
shapes: vocab 11 over 2 or 3 ranks) and three batches, one of them smaller than the world (a rank
gets no example). ``make_model("hf-gpt2" | "hf-llama" | "hf-qwen3")`` gives transformers' own
models of the same vocabulary instead (tiny configs built here, never downloaded), trained with
``hf_loss``."""

import torch

from fsdpx.models.gpt import GPT, GPTConfig
from privacy.step import DPConfig

NUM_EXAMPLES = 40


def make_model(kind: str = "gpt"):
    torch.manual_seed(5)
    if kind in ("gpt", "gpt-untied"):
        return GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=6,
                             tie_weights=kind == "gpt")).double()
    import transformers

    if kind == "hf-gpt2":
        config = transformers.GPT2Config(vocab_size=11, n_positions=4, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(config).double()
    if kind == "hf-qwen3":  # per-head query/key norms, moved off their initial ones
        config = transformers.Qwen3Config(vocab_size=11, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                                          head_dim=4, intermediate_size=12, num_hidden_layers=2,
                                          max_position_embeddings=4, use_cache=False)
        model = transformers.Qwen3ForCausalLM(config).double()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
        return model
    config = transformers.LlamaConfig(vocab_size=11, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=12, num_hidden_layers=2, max_position_embeddings=4,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config).double()


def tp_plan(kind: str, model):
    """The ready tensor-parallel plan of ``make_model(kind)``."""
    from fsdpx.models.tp_plans import gpt2_plan, gpt_plan, llama_plan, qwen3_plan

    return {"gpt": gpt_plan, "gpt-untied": gpt_plan, "hf-gpt2": gpt2_plan, "hf-llama": llama_plan,
            "hf-qwen3": qwen3_plan}[kind](model.config)


def loss_for(kind: str):
    """What a user writes: our GPT returns logits; transformers returns an output object."""
    from fsdpx.models.gpt import token_loss

    return token_loss if kind.startswith("gpt") else hf_loss


def hf_loss(out, targets):
    """Per-example loss ``(B,)`` from a transformers ``CausalLMOutput``, as a user writes it."""
    import torch.nn.functional as F

    b, t, v = out.logits.shape
    return F.cross_entropy(out.logits.reshape(b * t, v), targets.reshape(b * t), reduction="none").view(b, t).mean(1)


def _batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (b, 4), generator=g), torch.randint(0, 11, (b, 4), generator=g)


BATCHES = [_batch(5, 1), _batch(1, 2), _batch(4, 3)]


def private_config() -> DPConfig:
    return DPConfig(clip_norm=0.5, noise_multiplier=0.8, sample_rate=0.1, method="ghost")
