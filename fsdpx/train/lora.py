"""LoRA settings: ``--lora 'r = 8, alpha = 16, targets = ["q_proj", "v_proj"]'`` on the command
line, ``[model.lora]`` in a config file, checked here without torch (``fsdpx train --help`` and a
refused value answer before it is imported). The adapters themselves are
:mod:`fsdpx.train.lora_model`'s.

    lora_settings({"r": 4, "targets": ["c_attn"]})
    # {'r': 4, 'alpha': 8, 'targets': ['c_attn'], 'dropout': 0.0, 'merge': False}

Keys (peft's ``LoraConfig`` names in brackets):

* ``r`` (``r``): the adapters' rank, an integer >= 1; default 8, peft's.
* ``alpha`` (``lora_alpha``): the adapters' output is scaled by ``alpha / r``; default 8, peft's
  (not ``r``: a run that gives only ``r = 16`` gets scale 0.5, as peft gives it).
* ``targets`` (``target_modules``): module names (the last part of a module's dotted name, e.g.
  ``"q_proj"``, or a whole dotted name) to wrap; default peft's for the model's type (GPT-2
  ``["c_attn"]``, Llama ``["q_proj", "v_proj"]``), refused by name for a type peft has none for.
* ``dropout`` (``lora_dropout``): only 0. Dropout on the adapters' input draws a mask per step
  that a sharded run and one process would draw differently, so the runs would no longer equal
  each other; the privacy guarantee does not need it. Refused when > 0.
* ``merge``: at the end of the run, export the merged model (the base weights plus the adapters'
  product, loadable by ``AutoModelForCausalLM.from_pretrained``) instead of the adapter alone
  (``adapter_config.json`` + ``adapter_model.safetensors``, loadable by
  ``peft.PeftModel.from_pretrained``). ``fsdpx export CKPT --to OUT --merge`` does the same from
  any checkpoint.

Every message starts with ``lora`` so the command line names the flag or key the user gave
(:mod:`fsdpx.train.wording`). Proven by ``tests/test_lora_cli.py``.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from .errors import ConfigError

DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 8, "targets": None, "dropout": 0.0, "merge": False}
"""Every key of a LoRA table and its default (peft's ``LoraConfig`` defaults for ``r`` and
``alpha``; ``targets`` ``None``: peft's default modules for the model's type)."""


PEFT_NAMES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "target_modules": "targets",
              "lora_dropout": "dropout"}
"""peft's ``LoraConfig`` names (and "rank") -> the key here: named in the error for a table that uses them."""


def lora_settings(value: Mapping[str, Any]) -> dict[str, Any]:
    """The LoRA table ``value`` checked, with every key of :data:`DEFAULTS` filled in.

    Guarantees: the result holds exactly the keys of ``DEFAULTS``; ``r`` an int >= 1, ``alpha`` a
    number > 0, ``targets`` ``None`` or a non-empty list of non-empty strings, ``dropout`` 0.0,
    ``merge`` a bool. Raises :class:`ConfigError` starting with ``lora``: an unknown key (with the
    closest known one), a value of the wrong type or range, ``dropout > 0``
    (``tests/test_lora_cli.py::test_lora_values_are_refused_by_name``)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"lora must be a table such as 'r = 8, alpha = 16, targets = [\"q_proj\"]', got {value!r}")
    unknown = [k for k in value if k not in DEFAULTS]
    if unknown:
        close = [PEFT_NAMES[unknown[0]]] if unknown[0] in PEFT_NAMES else \
            difflib.get_close_matches(unknown[0], list(DEFAULTS), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else f" (known: {', '.join(DEFAULTS)})"
        raise ConfigError(f"lora has no key {unknown[0]!r}{hint}")
    out = {**DEFAULTS, **value}
    r, alpha, targets, dropout, merge = (out[k] for k in DEFAULTS)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"lora r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"lora alpha must be a number > 0, got {alpha!r}")
    if targets is not None and not (isinstance(targets, list) and targets
                                    and all(isinstance(t, str) and t for t in targets)):
        raise ConfigError(f"lora targets must be a list of module names such as [\"q_proj\", \"v_proj\"], got"
                          f" {targets!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or dropout != 0:
        raise ConfigError(f"lora dropout must be 0, got {dropout!r}: a dropout mask drawn per step would differ between"
                          " a sharded run and one process (the privacy guarantee does not need it)")
    if not isinstance(merge, bool):
        raise ConfigError(f"lora merge must be true or false, got {merge!r}")
    return {"r": r, "alpha": alpha, "targets": None if targets is None else list(targets), "dropout": 0.0,
            "merge": merge}


def lora_text(lora: Mapping[str, Any]) -> str:
    """``lora`` as the body of the TOML inline table ``--lora`` takes (``r = 4, alpha = 8, ...``),
    ``targets`` left out when it is the model's default."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(f'"{t}"' for t in v) + "]"
        return repr(v) if isinstance(v, float) else str(v)

    return ", ".join(f"{k} = {value(v)}" for k, v in lora.items() if v is not None)
