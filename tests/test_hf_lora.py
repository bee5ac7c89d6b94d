"""DP fine-tuning with LoRA adapters, as users build them: ``peft.get_peft_model`` on an
unmodified transformers model, only the adapters trainable.

peft wraps each targeted linear (``q_proj``, ``v_proj``, ``down_proj`` of Llama; GPT-2's fused
``c_attn``, a ``Conv1D``) in a layer that adds ``lora_B(lora_A(x)) * scaling`` to the frozen
base layer's output. ``lora_A`` and ``lora_B`` are plain ``nn.Linear`` modules, so ghost
clipping takes them as they are: no rule for peft, no wrapper. Judged against the oracle of
``support.oracle.loop_grads`` (one example at a time, float64) and, sharded, against the unsharded
steps (ZeRO-3 over two simulated ranks, plain and private).
"""

from __future__ import annotations

import pytest
import torch

from fsdpx.sharding import Mesh
from privacy import clipped_grad, per_sample_norms

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from support import tp_hf  # noqa: E402
from support.hf import gpt2, llama, lm_loss, padded_batch  # noqa: E402
from support.oracle import clipped_sum_of, loop_grads, norms_of  # noqa: E402
from support.tolerance import assert_close, float32_ops  # noqa: E402

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn"]}


def _lora(family: str):
    base = llama("eager") if family == "llama" else gpt2("eager")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS[family], lora_dropout=0.0,
                             init_lora_weights=False)  # random B: the adapters' gradients are not zero
    return peft.get_peft_model(base, config)


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_lora_adapters_per_example_norms_and_clipped_sums_equal_the_loop(family, method):
    model = _lora(family).eval()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert params and all("lora_" in k for k in params)
    batch = padded_batch([5, 8, 3], causal=True)
    f32 = bool(float32_ops(model, batch[0]))  # Llama's RMSNorm and eager softmax
    oracle = loop_grads(model, params, batch, lm_loss)
    assert_close(per_sample_norms(model, params, batch, lm_loss, method=method), norms_of(oracle), f32)
    grads, _ = clipped_grad(model, params, batch, lm_loss, clip_norm=0.5, method=method)
    want = clipped_sum_of(oracle, 0.5)
    for name in params:
        assert_close(grads[name], want[name], f32, msg=name)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_lora_under_zero3_equals_the_unsharded_steps(private):
    """Only the adapters trainable (the base frozen, as peft leaves it), ZeRO-3 over dp=2:
    two steps equal the unsharded steps, float64 rel 1e-10."""
    model = _lora("llama")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    tp_hf.check(model, None, Mesh(dp=2), tp_hf.dp_config("ghost") if private else None, frozen=frozen)
