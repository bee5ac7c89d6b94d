"""LoRA adapters on a transformers model, as peft makes them, and the two ways they leave a run.

    inject_lora(model, {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], ...}, base="my-llama")
    frozen_base(model)                       # Freezing: every parameter but the adapters, from step 0
    write_adapter(model, tensors, out)       # adapter_config.json + adapter_model.safetensors (peft's)
    plain, merged = merged_model(model, tensors)   # the base model holding W + (alpha / r) B A

The model stays the user's class (``peft.inject_adapter_in_model``: ``GPT2LMHeadModel``, not a
``PeftModel`` around it), each targeted layer replaced by peft's LoRA layer: its base layer
(``...q_proj.base_layer.weight``) and ``lora_A``/``lora_B`` (``...q_proj.lora_A.default.weight``),
plain ``nn.Linear`` modules that ghost clipping takes as they are. ``lora_A`` is drawn from the
run's seed, ``lora_B`` is zero, so step 0 computes what the base model does.

What trains: the adapters alone. The base weights are frozen by a :class:`Freezing` from step 0
(:mod:`fsdpx.optim.freezing`): no gradient, no per-example norm, no noise, no update, in one process
and sharded. They stay part of the run's state (sharded, checkpointed, with an optimizer state
that is allocated and never touched) so every layout, checkpoint and resume works as for a whole
model. The cost: the base's optimizer memory (2 floats per base weight with AdamW) and its bytes
in each checkpoint. The gain: ZeRO-3 shards the frozen base like any weight, 3/N of the base per
rank (weight and two moments) where a base kept beside the state would be whole on every rank;
for N >= 3 ranks that is less. (A state holding the adapters alone, the base sharded outside it,
would save both; not done yet.)
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor, nn

from fsdpx.optim.freezing import Freezing

from .errors import ConfigError

ADAPTER = "default"  # peft's adapter name inside the model
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
SHOWN = 8  # module names listed in an error
_ADAPTER_KEY = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.")


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("lora needs the peft package (pip install peft)") from None
    return peft


def default_targets(model: nn.Module) -> list[str] | None:
    """peft's default target modules for ``model``'s type (``config.model_type``), or None."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    found = defaults.get(getattr(getattr(model, "config", None), "model_type", None))
    return list(found) if found else None


def layer_names(model: nn.Module) -> list[str]:
    """The distinct last parts of the names of ``model``'s modules that hold a weight of their
    own (the candidates for ``targets``), in the order they are met."""
    out: dict[str, None] = {}
    for name, module in model.named_modules():
        if name and isinstance(getattr(module, "weight", None), Tensor) and not list(module.children()):
            out.setdefault(name.rsplit(".", 1)[-1], None)
    return list(out)


def inject_lora(model: nn.Module, lora: Mapping[str, Any], *, base: str | None) -> nn.Module:
    """``model`` with peft's LoRA layers put in place of its ``lora["targets"]`` (or peft's
    default modules for its type), ranked ``r``, scaled ``alpha / r``; ``base`` (the base model's
    path or class) is recorded in the adapter's config. Draws ``lora_A`` from torch's global RNG
    (the caller seeds it); ``lora_B`` is zero. Returns ``model`` itself, changed in place.

    Raises :class:`ConfigError` starting with ``lora``: a target matching no module (naming some
    of the model's modules), a model type without peft defaults and no ``targets``, a module peft
    cannot wrap (``tests/test_lora_cli.py::test_a_target_matching_no_module_is_refused_naming_modules``)."""
    peft = _peft()
    targets = lora["targets"] or default_targets(model)
    names = layer_names(model)
    shown = ", ".join(names[:SHOWN]) + (" ..." if len(names) > SHOWN else "")
    if targets is None:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"lora has no default targets for model type {kind!r}: give targets = [...] (its modules"
                          f" include {shown})")
    modules = dict(model.named_modules())
    hit = {t: [m for n, m in modules.items() if n == t or n.endswith("." + t)] for t in targets}
    missing = [t for t, found in hit.items() if not found]
    if missing:
        raise ConfigError(f"lora targets {missing} match no module of {type(model).__name__} (its modules include"
                          f" {shown})")
    # transformers' Conv1D (GPT-2's c_attn) stores its weight (in, out): peft's fan_in_fan_out
    transposed = any(type(m).__name__ == "Conv1D" for found in hit.values() for m in found)
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(targets), lora_dropout=0.0,
                             fan_in_fan_out=transposed, base_model_name_or_path=base, task_type="CAUSAL_LM")
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # a targeted module of a kind peft has no LoRA layer for
        raise ConfigError(f"lora targets {list(targets)}: {(str(e).splitlines() or [''])[0]}") from None
    for p in model.parameters():  # peft turned the base's off; the run's Freezing decides (sharding plans
        p.requires_grad_(True)    # cover the parameters that require grad: the base is sharded too)
    return model


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA adapters (:func:`inject_lora`)."""
    return bool(adapter_names(model))


def adapter_names(model: nn.Module) -> list[str]:
    """The canonical names of ``model``'s adapter parameters (``...lora_A.default.weight``)."""
    return [n for n, _ in model.named_parameters() if _ADAPTER_KEY.search(n)]


def frozen_base(model: nn.Module) -> Freezing:
    """Every parameter of ``model`` but its adapters, frozen from step 0 for the whole run."""
    adapters = set(adapter_names(model))
    return Freezing({0: [n for n, _ in model.named_parameters() if n not in adapters]})


def adapter_config(model: nn.Module) -> Any:
    """The peft ``LoraConfig`` :func:`inject_lora` gave ``model``."""
    return model.peft_config[ADAPTER]


def write_adapter(model: nn.Module, tensors: Mapping[str, Tensor], where: Path) -> None:
    """Write the adapters among ``tensors`` (``{canonical name: tensor}``) into the directory
    ``where`` as ``PeftModel.save_pretrained`` does: ``adapter_config.json`` (the base model's
    path or class as ``base_model_name_or_path``) and ``adapter_model.safetensors``, keys
    ``base_model.model.<module>.lora_A.weight``. Guarantee: ``PeftModel.from_pretrained(base,
    where)`` computes the logits of ``model`` holding ``tensors``
    (``tests/test_lora_cli.py::test_a_private_lora_run_trains_the_adapters_alone_and_exports_them``)."""
    from safetensors.torch import save_file

    adapters = {"base_model.model." + _ADAPTER_KEY.sub(r".\1.", n): tensors[n].detach().cpu().contiguous()
                for n in adapter_names(model)}
    save_file(adapters, str(where / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.copy(adapter_config(model))
    config.inference_mode = True  # as PeftModel.save_pretrained records it: loaded for inference unless asked
    config.save_pretrained(str(where))


def merged_model(model: nn.Module, tensors: Mapping[str, Tensor]) -> tuple[nn.Module, dict[str, Tensor]]:
    """The base model of ``model`` (its class and config, parameters on ``meta``) and its
    parameters with the adapters merged: each wrapped layer's weight ``W + (alpha / r) B A``
    (transposed for GPT-2's ``Conv1D``, peft's ``fan_in_fan_out``), every other tensor as given.
    ``model`` is left as it is. Guarantee: the merged model computes the logits of ``model``
    holding ``tensors``, within fp32 rounding (``tests/test_lora_cli.py::
    test_the_merged_export_loads_with_from_pretrained_and_gives_the_same_logits``)."""
    from .pretrained import parameters_on_meta

    merged: dict[str, Tensor] = {}
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    for name in (n for n, _ in model.named_parameters()):
        if _ADAPTER_KEY.search(name):
            continue
        merged[name.replace(".base_layer.", ".")] = tensors[name]
    for name, layer in layers.items():
        a, b = tensors[f"{name}.lora_A.{ADAPTER}.weight"], tensors[f"{name}.lora_B.{ADAPTER}.weight"]  # (r, in), (out, r)
        delta = (b @ a) * layer.scaling[ADAPTER]  # (out, in)
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        merged[f"{name}.weight"] = tensors[f"{name}.base_layer.weight"] + delta.to(tensors[f"{name}.base_layer.weight"])
    with parameters_on_meta():
        plain = type(model)(model.config)
    buffers = dict(model.named_buffers())
    for name, buf in plain.named_buffers():
        source = buffers.get(name)
        if source is not None and source.shape == buf.shape:
            buf.copy_(source)
    return plain, merged
