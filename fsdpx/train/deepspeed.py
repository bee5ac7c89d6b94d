"""A DeepSpeed JSON's ZenFlow as ``[offload]`` settings (``fsdpx train --deepspeed-config ds.json``).

    read_deepspeed("ds.json")   # DeepSpeedFile(values={"offload": "zenflow", "offload_topk": 0.1, ...},
                                #               unread=["train_batch_size", "zero_optimization.stage"])

Read: ``zero_optimization.zenflow`` and ``zero_optimization.offload_optimizer``, as DeepSpeed
reads them. Their keys map onto the ``[offload]`` settings (:class:`fsdpx.train.config.OffloadSettings`):

===============================  ==================================================
DeepSpeed key                    setting
===============================  ==================================================
zenflow (the block is present)   offload = "zenflow"
zenflow.topk_ratio               offload_topk
zenflow.update_interval          offload_interval (an int or "auto")
zenflow.select_strategy          offload_select_strategy ("step", "epoch", "auto")
zenflow.select_interval          offload_select_interval (an int or "auto")
zenflow.full_warm_up_rounds      offload_full_warm_up_rounds
zenflow.overlap_step             offload_overlap_step
offload_optimizer.device         "cpu": ZenFlow's host (without a zenflow block:
                                 offload = "zero", ZeRO-Offload); "none": no offload
offload_optimizer.pin_memory     true: what fsdpx does (its host copies are pinned)
===============================  ==================================================

A zenflow key the file leaves out takes DeepSpeed's default, not fsdpx's: a DeepSpeed file
means what it means to DeepSpeed (``select_strategy`` "auto", ``select_interval`` and
``update_interval`` "auto", ``overlap_step`` false, ``topk_ratio`` 0.1, no warm-up). Flags
typed on the command line and keys of the ``--config`` file win over the file
(:func:`fsdpx.train.cli.config_from_args`).

Refused (:class:`ConfigFileError`, one line naming the file, the key and ``--deepspeed-config``,
exit 2, before anything is written): a key inside the two blocks that fsdpx does not read
(``auto_ratio``, ``pt_reserved_cores_perc``, ``nvme_path``, ...: every such key at once),
``offload_optimizer.device`` other than "cpu" or "none" (or "none" beside a zenflow block),
``pin_memory: false``, a value of the wrong type, a file that is not a JSON object. The other
sections (``train_batch_size``, ``fp16``, ``optimizer``, ``zero_optimization.stage``, ...) are
not read; :attr:`DeepSpeedFile.unread` names them and ``fsdpx train`` says so in one line.
Proven by ``tests/test_deepspeed_config.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigFileError, OffloadSettings
from .errors import ConfigError

ZENFLOW_KEYS: dict[str, str] = {
    "topk_ratio": "offload_topk", "update_interval": "offload_interval",
    "select_strategy": "offload_select_strategy", "select_interval": "offload_select_interval",
    "full_warm_up_rounds": "offload_full_warm_up_rounds", "overlap_step": "offload_overlap_step",
}
"""DeepSpeed's zenflow key -> the ``[offload]`` setting it sets."""

DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "topk_ratio": 0.1, "update_interval": "auto", "select_strategy": "auto", "select_interval": "auto",
    "full_warm_up_rounds": 0, "overlap_step": False,
}
"""DeepSpeed's defaults of the zenflow keys (``ZenFlowConfig``)."""

OFFLOAD_OPTIMIZER_KEYS = ("device", "pin_memory")
FLAG = "--deepspeed-config"


@dataclass(frozen=True)
class DeepSpeedFile:
    """What a DeepSpeed file sets: ``values`` by flat name (``offload``, ``offload_topk``, ...)
    and ``unread``, the dotted names of its other sections and ``zero_optimization`` keys."""

    values: dict[str, Any]
    unread: list[str]


def read_deepspeed(path: str | Path) -> DeepSpeedFile:
    """The ``[offload]`` settings of the DeepSpeed JSON at ``path`` (module docstring's table).
    Raises :class:`ConfigFileError` (one line naming the file, the key and the flag) as the
    module docstring lists."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ConfigFileError(f"{FLAG}: cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"{FLAG} {path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{FLAG} {path}: a DeepSpeed config is a JSON object")
    zero = doc.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigFileError(f"{FLAG} {path}: zero_optimization must be an object")
    unread = [k for k in doc if k != "zero_optimization"]
    unread += [f"zero_optimization.{k}" for k in zero if k not in ("zenflow", "offload_optimizer")]
    zenflow, device = _block(zero, "zenflow", path), _block(zero, "offload_optimizer", path)
    unknown = [f"zero_optimization.zenflow.{k}" for k in (zenflow or {}) if k not in ZENFLOW_KEYS]
    unknown += [f"zero_optimization.offload_optimizer.{k}" for k in (device or {}) if k not in OFFLOAD_OPTIMIZER_KEYS]
    if unknown:
        them = "it" if len(unknown) == 1 else "them"
        raise ConfigFileError(f"{FLAG} {path}: fsdpx does not read {', '.join(unknown)}: remove {them}"
                              " (fsdpx.train.deepspeed lists the keys it maps)")
    return DeepSpeedFile({**_offload_kind(zenflow, device, path), **_zenflow_values(zenflow, path)}, unread)


def _block(zero: dict, name: str, path: Path) -> dict | None:
    block = zero.get(name)
    if block is not None and not isinstance(block, dict):
        raise ConfigFileError(f"{FLAG} {path}: zero_optimization.{name} must be an object, got {block!r}")
    return block


def _offload_kind(zenflow: dict | None, optimizer: dict | None, path: Path) -> dict[str, Any]:
    """``{"offload": kind}`` from the two blocks (nothing when neither is there)."""
    where = f"{FLAG} {path}: zero_optimization.offload_optimizer"
    device = (optimizer or {}).get("device", "cpu" if optimizer is not None or zenflow is not None else None)
    if (optimizer or {}).get("pin_memory", True) is not True:
        raise ConfigFileError(f"{where}.pin_memory: fsdpx always pins its host copies; remove it or set it to true")
    if device is None:
        return {}
    if device not in ("cpu", "none"):
        raise ConfigFileError(f"{where}.device: fsdpx offloads to \"cpu\" (or \"none\"), got {device!r}")
    if device == "none" and zenflow is not None:
        raise ConfigFileError(f"{where}.device \"none\" beside a zenflow block: ZenFlow's host is the CPU (\"cpu\")")
    return {"offload": "zenflow" if zenflow is not None else ("zero" if device == "cpu" else "none")}


def _zenflow_values(zenflow: dict | None, path: Path) -> dict[str, Any]:
    """The zenflow block's settings, DeepSpeed's defaults for the keys it leaves out, each
    value's type checked (the ranges are :class:`OffloadSettings`'s)."""
    if zenflow is None:
        return {}
    strategy = zenflow.get("select_strategy", DEEPSPEED_DEFAULTS["select_strategy"])
    if strategy in ("step", "epoch") and "select_interval" not in zenflow:
        raise ConfigFileError(f"{FLAG} {path}: zero_optimization.zenflow.select_strategy {strategy!r} needs a"
                              " select_interval (a number, as DeepSpeed asks)")
    out = {}
    for key, field in ZENFLOW_KEYS.items():
        value = zenflow.get(key, DEEPSPEED_DEFAULTS[key])
        if not _fits(key, value):
            raise ConfigFileError(f"{FLAG} {path}: zero_optimization.zenflow.{key} must be {_WORDS[key]},"
                                  f" got {value!r}")
        out[field] = float(value) if key == "topk_ratio" else value
    try:
        OffloadSettings(**out)  # the ranges and combinations, worded with DeepSpeed's keys
    except ConfigError as err:
        words = str(err)
        for key, field in sorted(ZENFLOW_KEYS.items(), key=lambda kv: -len(kv[1])):
            words = words.replace(field, f"zenflow.{key}")
        raise ConfigFileError(f"{FLAG} {path}: {words}") from None
    return out


_WORDS = {"topk_ratio": "a number", "update_interval": "an integer or \"auto\"",
          "select_interval": "an integer or \"auto\"", "select_strategy": "\"step\", \"epoch\" or \"auto\"",
          "full_warm_up_rounds": "an integer", "overlap_step": "true or false"}


def _fits(key: str, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return {"topk_ratio": is_int or isinstance(value, float), "update_interval": is_int or value == "auto",
            "select_interval": is_int or value == "auto", "select_strategy": value in ("step", "epoch", "auto"),
            "full_warm_up_rounds": is_int, "overlap_step": isinstance(value, bool)}[key]
