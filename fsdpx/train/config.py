"""The configuration of a run: :class:`RunConfig`, a tree of one small value per concern, and the
``--config`` file that fills it.

    config = RunConfig.of(steps=300, target_epsilon=8.0)       # from Python, by flag names
    config.privacy.target_epsilon, config.parallelism.tp        # read by section
    values = read_file("run.toml")                             # {field: value}, checked
    print(to_toml(config))                                     # the resolved file, loadable again

The tree mirrors the config file: ``config.run`` (``[run]``), ``.model``, ``.data``, ``.eval``,
``.privacy``, ``.parallelism`` (a :class:`fsdpx.train.layout.Layout`, the one parallel layout
value of the project), ``.offload``, ``.checkpoints``, ``.logging``. Every setting also has a
flat name, unique across the tree, which is its flag (``--offload-topk`` is ``offload_topk``) and
its full key in the file; inside its section it is the attribute of the same name, except the
setting named like its section, which is ``kind`` (``[model] kind``, ``config.model.kind``).

A config file is TOML with one table per section; a key is a field's flat name or, in its
section, its short name (``[model] kind`` is ``model``, ``[offload] topk`` is ``offload_topk``,
``[checkpoints] every`` is ``ckpt_every``). Keys before the first table belong to ``[run]``::

    steps = 200
    [model]
    kind = "transformers"
    path = "examples/tiny-gpt2"
    [data]
    path = "notes.txt"
    tokenizer = "bytes"
    block_size = 64

Flags typed on the command line override the file (:func:`merge`). Unknown sections and keys
(with the closest known one), keys in the wrong section and values of the wrong type are
:class:`ConfigFileError`, a :class:`ConfigError`: ``fsdpx train`` prints one line and exits 2.
Each check of a value lives in the section that owns it; checks across sections live in
:meth:`RunConfig.__post_init__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from . import data
from .errors import ConfigError
from .layout import Layout
from .lora import lora_settings

if TYPE_CHECKING:
    from fsdpx.models.gpt import GPTConfig

# This module loads no torch (``fsdpx train --help`` builds its defaults from it before anything
# heavy is imported: ``tests/test_fast_feedback.py``); the model's config is imported where it is made.

MODEL_KINDS = ("gpt", "transformers", "python")
DATA_KINDS = ("auto", "corpus", "text", "npy", "bin", "dataset", "python")
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int16", "int32", "int64")
DEVICES = ("auto", "cpu", "cuda")
OFFLOAD_KINDS = ("none", "zenflow", "zero")
PRECISIONS = ("fp32", "bf16")  # privacy.precision.PRECISIONS, named here without torch
SELECT_STRATEGIES = ("step", "epoch", "auto")
NOISE_MECHANISMS = ("independent", "banded", "blt")  # privacy.mechanisms
OPTIMIZERS = ("adamw", "sgd")  # fsdpx.optim

MAX_NOISE_MULTIPLIER = 10.0
"""Default largest noise multiplier a segment may be given (``--max-noise-multiplier``,
:mod:`fsdpx.train.budget`): past about 10 a small model learns next to nothing, so a plan that
needs more is refused instead."""


def _set(obj: Any, **values: Any) -> None:
    """Normalise fields of a frozen dataclass while it is built."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class RunSettings:
    """``[run]``: how long, from which seed, with which optimizer, with what frozen, and where.

    ``optimizer``: "adamw" (``fsdpx.optim.adamw``: torch's AdamW defaults, weight decay 0.01) or
    "sgd" (``fsdpx.optim.sgd``: torch's SGD, heavy-ball ``momentum``, 0 by default; the setting
    banded noise helps most, ``docs/performance.md``), at learning rate ``lr``. A resume keeps
    the optimizer (its state is in the checkpoint) and may change ``lr`` and a nonzero
    ``momentum``'s value.

    ``device``: where the model, optimizer state and each step's batch live
    (:mod:`fsdpx.train.device`): "cpu", "cuda" (cuda:LOCAL_RANK under torchrun, NCCL between
    processes) or "auto" (cuda when there is a GPU per process). Default cpu: a run does not
    change with the machine it lands on. Asked anew by every segment: a checkpoint written on a
    GPU resumes on the CPU and back. ``freeze`` (:meth:`fsdpx.optim.Freezing.parse`):
    ``"wte,wpe@0-100;lm_head@50-"`` freezes names (parameters, tied aliases or modules) for steps
    ``start <= t < stop``; frozen ones get no gradient, norm, noise or update, and their optimizer
    state is kept as it is. ``precision`` (:mod:`privacy.precision`): "fp32", or "bf16": the
    model's forward (and so its backward) computes in bf16 under autocast; master weights,
    optimizer moments, per-example norms, clip factors, clipped sums and noise stay fp32. "fp16"
    is refused by name (it would need dynamic loss scaling, not built). A resume may change it:
    the checkpoint holds fp32 either way."""

    steps: int = 300
    seed: int = 0
    lr: float = 1e-2
    optimizer: str = "adamw"
    momentum: float = 0.0
    freeze: str | None = None
    device: str = "cpu"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision == "fp16":
            raise ConfigError("precision fp16 is not supported: fp16 needs dynamic loss scaling (a skipped overflow "
                              "step would still spend privacy), which is not built; bf16 needs no loss scaling")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.lr >= 0:  # 0: the model's loss on the run's batches, its weights kept (a loaded model checked)
            raise ConfigError(f"lr must be >= 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError(f"momentum {self.momentum:g} is sgd's: it needs optimizer sgd ({self.optimizer}'s first"
                              " moment decays at 0.9, its default)")
        if self.freeze:
            from fsdpx.optim.freezing import Freezing

            try:
                Freezing.parse(self.freeze)
            except ValueError as err:
                raise ConfigError(f"freeze {self.freeze!r}: {err}") from None


@dataclass(frozen=True)
class ModelSettings:
    """``[model]``: what trains (:mod:`fsdpx.train.sources`). ``kind``: "gpt", the built-in GPT
    (``n_layer`` x ``n_embd``, ``n_head`` heads; vocabulary ``vocab_size``, default the data's);
    "transformers": ``model_path`` (a local directory holding config.json, or the file) or
    ``model_class`` (a transformers config or causal-LM class name), ``model_fields`` set on its
    config, never downloaded, initialised from the seed unless the directory holds safetensors
    weights (:mod:`fsdpx.train.pretrained`: then it starts from them); or "python": your own functions, each
    named "module:qualname" (:mod:`fsdpx.train.refs`) and imported by every process:
    ``model_fn(hparams) -> nn.Module`` (called with the torch RNG seeded by ``seed``) and
    ``loss_fn(model output, targets) -> (B,)`` per-example losses; ``hparams`` (a table of JSON
    values) is passed to them and to ``data_fn``. ``lora`` (``--lora 'r = 8, alpha = 16, targets =
    ["q_proj", "v_proj"]'``, ``[model.lora]``; :mod:`fsdpx.train.lora`): a transformers model
    trains LoRA adapters only, its base weights frozen (:mod:`fsdpx.train.lora_model`)."""

    kind: str = "gpt"
    model_path: str | None = None
    model_class: str | None = None
    model_fields: dict | None = dataclasses.field(default=None, hash=False)
    vocab_size: int | None = None
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    model_fn: str | None = None
    loss_fn: str | None = None
    hparams: dict | None = dataclasses.field(default=None, hash=False)
    lora: dict | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.lora is not None:
            _set(self, lora=lora_settings(self.lora))
        if self.kind not in MODEL_KINDS:
            raise ConfigError(f"model must be one of {MODEL_KINDS}, got {self.kind!r}")
        if min(self.n_layer, self.n_head, self.n_embd) < 1:
            raise ConfigError("n_layer, n_head, n_embd and block_size must all be >= 1")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.model_fields is not None and not isinstance(self.model_fields, dict):
            raise ConfigError(f"model_fields must be a table of config fields, got {self.model_fields!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"vocab_size must be >= 1, got {self.vocab_size}")


@dataclass(frozen=True)
class DataSettings:
    """``[data]``: the examples (:mod:`fsdpx.train.sources`). ``kind``: "corpus" (the embedded
    one, ``corpus_chars`` long) or a file at ``data_path``: "text" (tokenised by ``tokenizer``:
    "bytes" or a local tokenizer directory), "npy" / "bin" (token ids; a .bin is raw
    ``data_dtype``), "dataset" (``datasets.load_from_disk``: ``data_column`` of ``data_split``);
    "auto" reads the kind off the path; "python": ``data_fn(hparams) -> (inputs, targets)``, the
    whole dataset (with ``[model] kind = "python"``). ``block_size``: tokens per example."""

    kind: str = "auto"
    data_path: str | None = None
    data_fn: str | None = None
    tokenizer: str | None = None
    data_dtype: str = "uint16"
    data_column: str | None = None
    data_split: str = "train"
    block_size: int = 32
    corpus_chars: int = data.DEFAULT_CHARS

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError("n_layer, n_head, n_embd and block_size must all be >= 1")
        if self.kind not in DATA_KINDS:
            raise ConfigError(f"data must be one of {DATA_KINDS}, got {self.kind!r}")
        if self.kind not in ("auto", "corpus", "python") and self.data_path is None:
            raise ConfigError(f"data = {self.kind!r} needs data_path")
        if self.kind == "corpus" and self.data_path is not None:
            raise ConfigError("data = \"corpus\" is the embedded corpus: drop data_path or set data to its kind")
        if self.data_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"data_dtype must be one of {TOKEN_DTYPES}, got {self.data_dtype!r}")


@dataclass(frozen=True)
class EvalSettings:
    """``[eval]``: held-out evaluation (:mod:`fsdpx.train.evaluation`). Every ``eval_every``
    steps and at the run's last step (``--steps``), the model's mean token loss and its
    exponential, the perplexity, on ``eval_batches`` batches of ``eval_batch_size`` examples
    (default: the training's expected batch size) of ``eval_data``: a file read as the training
    data is (its kind, tokenizer, ``block_size``, memory-mapped alike), the same examples at
    every evaluation and in every layout (``min(eval_batches * eval_batch_size, N)`` of its ``N``
    examples, evenly spaced). Forward only: no gradient, no noise, no accountant call, so it
    spends no privacy budget; its numbers are computed from the eval examples, which the
    guarantee does not cover (they must be disjoint from the training data: the training file
    given again is warned about). ``eval_data`` and ``eval_every`` go together."""

    eval_data: str | None = None
    eval_every: int | None = None
    eval_batches: int = 8
    eval_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.eval_every is not None and self.eval_data is None:
            raise ConfigError("eval_every needs eval_data, the held-out file to evaluate on")
        if self.eval_data is not None and self.eval_every is None:
            raise ConfigError("eval_data needs eval_every, the steps between evaluations (the last step is"
                              " evaluated too)")
        if self.eval_every is not None and self.eval_every < 1:
            raise ConfigError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.eval_batches < 1:
            raise ConfigError(f"eval_batches must be >= 1, got {self.eval_batches}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ConfigError(f"eval_batch_size must be >= 1, got {self.eval_batch_size}")

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates (``eval_data`` given)."""
        return self.eval_data is not None

    def due(self, step: int, last: int) -> bool:
        """Whether step ``step`` (1-based) is evaluated: a multiple of ``eval_every``, or ``last``
        (the run's ``--steps``); never when evaluation is off. A resumed run keeps the schedule:
        it depends on the step alone."""
        return self.enabled and (step % self.eval_every == 0 or step == last)


@dataclass(frozen=True)
class PrivacySettings:
    """``[privacy]``: the guarantee and how it is kept. Noise: ``noise_multiplier`` when given,
    otherwise the smallest one that spends at most ``target_epsilon`` over the run's steps.
    Batches: Poisson with ``sample_rate`` when given, otherwise with rate ``batch_size /
    num_examples`` (``batch_size`` is the EXPECTED size). The field that is not used is set to
    ``None``, so the resolved file shows only what the run used. ``private=False`` runs plain
    training on the same batches (both noise fields None). ``accounting_interval``: PLD
    discretization; coarser is faster and still an upper bound on epsilon (at the default run
    1e-2 reports 8.008 where 1e-4 reports 8.001, and composes 300 steps in 0.3 s, not 15 s)."""

    private: bool = True
    target_epsilon: float | None = 8.0
    noise_multiplier: float | None = None
    delta: float = 1e-5
    clip_norm: float = 1.0
    batch_size: float | None = 384.0
    sample_rate: float | None = None
    method: str = "auto"
    clipping: str = "flat"
    epsilon_budget: float | None = None
    accountant: str = "pld"
    accounting_interval: float = 1e-2
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER
    noise_mechanism: str = "independent"
    bands: int | None = None
    buffers: int | None = None
    min_separation: int | None = None
    audit_canaries: int | None = None

    def __post_init__(self) -> None:
        _check_mechanism(self)
        _check_audit(self)
        if self.noise_multiplier is not None or not self.private:
            _set(self, target_epsilon=None)
        if not self.private:
            _set(self, noise_multiplier=None)
        if self.sample_rate is not None:
            _set(self, batch_size=None)
        if self.batch_size is None and self.sample_rate is None:
            raise ConfigError("give batch_size (expected batch size) or sample_rate")
        if self.batch_size is not None and not self.batch_size > 0:
            raise ConfigError(f"batch_size must be > 0, got {self.batch_size}")
        if self.private and self.target_epsilon is None and self.noise_multiplier is None:
            raise ConfigError("a private run needs target_epsilon or noise_multiplier")
        if self.private and self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ConfigError(f"target_epsilon must be > 0, got {self.target_epsilon}")
        if not (self.max_noise_multiplier > 0 and math.isfinite(self.max_noise_multiplier)):
            raise ConfigError(f"max_noise_multiplier must be finite and > 0, got {self.max_noise_multiplier}")

    @property
    def groups(self) -> int:
        """The cyclic sampling groups of the run (``privacy.mechanisms.cyclic_sampling``): ``bands``
        of a banded mechanism, ``min_separation`` of a BLT (1 when not given), else 1 (Poisson
        sampling over the whole dataset)."""
        if self.noise_mechanism == "blt":
            return self.min_separation or 1
        return self.bands if self.noise_mechanism == "banded" else 1

    @property
    def budget(self) -> float | None:
        """The epsilon no step may exceed: ``epsilon_budget`` when given, else the target the run
        announced (a run "to epsilon 8" never takes a step past 8, resumed or not); None for a
        non-private run or one with a fixed noise multiplier and no budget."""
        if not self.private:
            return None
        return self.epsilon_budget if self.epsilon_budget is not None else self.target_epsilon


def _check_mechanism(p: PrivacySettings) -> None:
    """``noise_mechanism``, ``bands``, ``buffers`` and ``min_separation`` (``--noise-mechanism``,
    ``--bands``, ``--buffers``, ``--min-separation``): banded needs its bands, blt its buffers (its
    min separation is optional: 1), nothing else takes them; a mechanism needs a private run.
    Each refusal names the flag. (A min separation larger than the dataset is refused where the
    dataset's size is known: ``fsdpx.train.build.resolve_sample_rate``.)"""
    if p.noise_mechanism not in NOISE_MECHANISMS:
        raise ConfigError(f"noise_mechanism must be one of {NOISE_MECHANISMS}, got {p.noise_mechanism!r}")
    for flag, value in (("--buffers", p.buffers), ("--min-separation", p.min_separation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")
        if value is not None and p.noise_mechanism != "blt":
            raise ConfigError(f"{flag} {value} is for --noise-mechanism blt, not {p.noise_mechanism!r}")
    if p.noise_mechanism == "blt":
        if p.buffers is None:
            raise ConfigError("--noise-mechanism blt needs --buffers D (an integer >= 1)")
        if not p.private:
            raise ConfigError("--noise-mechanism blt is a way to add noise: a non-private run has none")
    if p.noise_mechanism == "banded":
        if p.bands is None or isinstance(p.bands, bool) or p.bands < 1:
            raise ConfigError(f"noise_mechanism \"banded\" needs --bands B (an integer >= 1), got bands={p.bands}")
        if not p.private:
            raise ConfigError("noise_mechanism \"banded\" is a way to add noise: a non-private run has none")
    elif p.bands is not None:
        raise ConfigError(f"bands={p.bands} is for --noise-mechanism banded, not {p.noise_mechanism!r}")


def _check_audit(p: PrivacySettings) -> None:
    """``audit_canaries`` (``--audit-canaries``): that many gradient canaries ride in the run and
    its summary ends with their audit (:mod:`privacy.gradient_canaries`); an int >= 2 on a
    private run with Poisson batches over the whole dataset, and few enough for the one-run
    bound at ``delta`` (``2 * canaries * delta <= 1``)."""
    m = p.audit_canaries
    if m is None:
        return
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        raise ConfigError(f"audit_canaries must be an integer >= 2, got {m!r}")
    if not p.private:
        raise ConfigError("audit_canaries audits a private run: a non-private run claims no epsilon to check")
    if p.noise_mechanism != "independent":
        raise ConfigError(f"audit_canaries with noise_mechanism {p.noise_mechanism!r} is not supported: the canaries"
                          " join batches by Poisson sampling over the whole dataset, a banded or BLT run samples cyclic groups")
    if 2 * m * p.delta > 1:
        raise ConfigError(f"audit_canaries={m} with delta={p.delta:g}: the one-run bound needs"
                          " 2 * canaries * delta <= 1")


@dataclass(frozen=True)
class OffloadSettings:
    """``[offload]``: the optimizer's offload. ``kind``: "none", "zenflow" (selected columns
    every step, the rest on the host every ``offload_interval`` steps, ``offload_topk`` of the
    columns selected) or "zero" (ZeRO-Offload: all optimizer state on the host).

    ZenFlow's knobs are DeepSpeed's (``zero_optimization.zenflow``; :mod:`offload.schedule`
    resolves them): ``offload_interval`` (DeepSpeed's ``update_interval``: steps per host
    window, or "auto": :mod:`offload.auto`'s coherence rule); ``offload_select_strategy``
    "step" (reselect every ``offload_select_interval`` steps, or "auto": the coverage rule of
    :mod:`offload.auto`; unset: every multiple of the window nearest below 100 steps, fsdpx's
    default), "epoch" (every ``offload_select_interval`` epochs, default 1) or "auto"
    (DeepSpeed's: every epoch; ``offload_select_interval`` unset or "auto");
    ``offload_full_warm_up_rounds`` (the first N steps update every parameter, as plain AdamW);
    ``offload_overlap_step`` (the host window runs beside the next steps, or inline: the same
    bits either way). ``offload_host_process`` (that window runs in a worker process of its own
    instead of a thread of the training process: the same bits; :mod:`offload.host_process`)
    with ``offload_host_threads`` intra-op threads, pinned to ``offload_host_cores`` ("0,1" or
    "2-5"; "" not pinned). ``deepspeed_config``: a DeepSpeed JSON whose ``zenflow`` and
    ``offload_optimizer`` blocks set these (:mod:`fsdpx.train.deepspeed`); any of them set by a
    flag or in this file wins over it."""

    kind: str = "none"
    offload_topk: float = 0.1
    offload_interval: int | str = 4
    offload_select_strategy: str = "step"
    offload_select_interval: int | str | None = None
    offload_full_warm_up_rounds: int = 0
    offload_overlap_step: bool = True
    offload_host_process: bool = False
    offload_host_threads: int = 1
    offload_host_cores: str = ""
    deepspeed_config: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in OFFLOAD_KINDS:
            raise ConfigError(f"offload must be none, zenflow or zero, got {self.kind!r}")
        if not 0 <= self.offload_topk <= 1:
            raise ConfigError(f"offload_topk must be in [0, 1], got {self.offload_topk}")
        for name in ("offload_interval", "offload_select_interval"):
            value = getattr(self, name)
            if value is not None and value != "auto" and not (_is_int(value) and value >= 1):
                raise ConfigError(f"{name} must be an integer >= 1 or \"auto\", got {value!r}")
        if self.offload_select_strategy not in SELECT_STRATEGIES:
            raise ConfigError(f"offload_select_strategy must be one of {', '.join(SELECT_STRATEGIES)},"
                              f" got {self.offload_select_strategy!r}")
        if self.offload_select_strategy == "auto" and _is_int(self.offload_select_interval):
            raise ConfigError("offload_select_strategy \"auto\" reselects every epoch: drop offload_select_interval"
                              " or choose offload_select_strategy \"step\" or \"epoch\"")
        if self.offload_select_strategy == "epoch" and self.offload_select_interval == "auto":
            raise ConfigError("offload_select_interval \"auto\" (the coverage rule) is for offload_select_strategy"
                              " \"step\"; with \"epoch\" give a number of epochs")
        if (self.offload_select_strategy == "step" and _is_int(self.offload_select_interval)
                and _is_int(self.offload_interval) and self.offload_select_interval % self.offload_interval):
            raise ConfigError(f"offload_select_interval={self.offload_select_interval} must be a multiple of"
                              f" offload_interval={self.offload_interval}: a reselection falls on a window end")
        if not (_is_int(self.offload_full_warm_up_rounds) and self.offload_full_warm_up_rounds >= 0):
            raise ConfigError(f"offload_full_warm_up_rounds must be an integer >= 0,"
                              f" got {self.offload_full_warm_up_rounds!r}")
        self._check_host_worker()

    def host_cores(self) -> tuple[int, ...]:
        """``offload_host_cores`` as sorted CPU numbers (``()``: not pinned)."""
        return parse_cores(self.offload_host_cores)

    def _check_host_worker(self) -> None:
        if not (_is_int(self.offload_host_threads) and self.offload_host_threads >= 1):
            raise ConfigError(f"offload_host_threads must be an integer >= 1, got {self.offload_host_threads!r}")
        cores = self.host_cores()
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(cores)
        if set(cores) - allowed:
            raise ConfigError(f"offload_host_cores {self.offload_host_cores!r}: CPUs {sorted(set(cores) - allowed)}"
                              f" are not among this process's ({_ranges(sorted(allowed))})")
        if not self.offload_host_process:
            typed = [n for n, v, d in (("offload_host_threads", self.offload_host_threads, 1),
                                       ("offload_host_cores", self.offload_host_cores, "")) if v != d]
            if typed:
                raise ConfigError(f"{typed[0]} sets ZenFlow's host worker process: it needs offload_host_process")
            return
        if self.kind != "zenflow":
            raise ConfigError(f"offload_host_process runs ZenFlow's host window in a process: it needs"
                              f" offload = \"zenflow\", got {self.kind!r}")
        if not self.offload_overlap_step:
            raise ConfigError("offload_host_process runs the host window beside the next steps: it needs"
                              " offload_overlap_step (without it the window runs inline, on the loop)")


def parse_cores(text: str) -> tuple[int, ...]:
    """``"0,2-4"`` -> ``(0, 2, 3, 4)`` (sorted, each once); ``""`` -> ``()``. Raises
    :class:`ConfigError` naming ``offload_host_cores`` on anything else."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ConfigError(f"offload_host_cores must be CPU numbers and ranges such as \"0,2-5\", got {text!r}")
        cores.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return tuple(sorted(cores))


def _ranges(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CheckpointSettings:
    """``[checkpoints]``: every ``ckpt_every`` steps into ``ckpt_dir`` (async, atomic, keep the
    last 3 of this run's own); ``resume`` continues from the newest intact one (same noise,
    batches and accountant) and is refused when there is none; ``resume_if_present`` continues
    from it when there is one and starts the run otherwise (elastic restarts, schedulers:
    :mod:`fsdpx.train.preflight`); ``resume_from`` (:mod:`fsdpx.train.resume`) branches from any
    intact checkpoint (a ``step_<N>`` directory or a root) into this run's own directory and
    checkpoint root (default ``<out>/<name>/ckpt``); the ``allow_*`` flags loosen what a resume
    refuses."""

    ckpt_dir: str | None = None
    ckpt_every: int = 50
    resume: bool = False
    resume_if_present: bool = False
    resume_from: str | None = None
    allow_budget_increase: bool = False
    allow_new_data: bool = False

    def __post_init__(self) -> None:
        if self.resume and self.ckpt_dir is None:
            raise ConfigError("resume needs ckpt_dir")
        if self.resume_if_present and self.ckpt_dir is None:
            raise ConfigError("resume_if_present needs ckpt_dir")
        modes = [m for m in ("resume", "resume_if_present", "resume_from") if getattr(self, m) not in (False, None)]
        if len(modes) > 1:
            raise ConfigError(f"give one of resume (the newest checkpoint of ckpt_dir), resume_if_present (that, or a"
                              f" new run when there is none) and resume_from (a branch), not {' and '.join(modes)}")
        if self.ckpt_every < 1:
            raise ConfigError(f"ckpt_every must be >= 1, got {self.ckpt_every}")


@dataclass(frozen=True)
class LoggingSettings:
    """``[logging]``: the run directory ``<out>/<name>``. One that holds files is refused
    (:mod:`fsdpx.train.preflight`) unless ``overwrite`` (its run files are replaced) or the run
    continues into it (``resume`` into the directory its checkpoints record, ``resume_if_present``).
    ``export``: at the end, the trained model into ``<out>/<name>/model`` (:mod:`fsdpx.train.export`)."""

    name: str = "private"
    out: str = "runs"
    overwrite: bool = False
    export: bool = True


SECTION_TYPES: dict[str, type] = {
    "run": RunSettings, "model": ModelSettings, "data": DataSettings, "eval": EvalSettings,
    "privacy": PrivacySettings,
    "parallelism": Layout, "offload": OffloadSettings, "checkpoints": CheckpointSettings, "logging": LoggingSettings,
}
"""The sections of a run, in the order of the config file: the attribute, the TOML table and the
value type of each."""


def _flat_name(section: str, attribute: str) -> str:
    return section if attribute == "kind" else attribute


FIELDS: dict[str, tuple[str, str]] = {
    _flat_name(s, f.name): (s, f.name) for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)}
"""Every setting's flat name (its flag and full key) -> ``(section, attribute)``."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on, one value per section (see the module doc). The defaults are
    the ~2 minute demo of ``fsdpx train``. Inconsistent values raise :class:`ConfigError`, each
    checked once: in its section, or here when it crosses sections.

    Build it by sections (``RunConfig(privacy=PrivacySettings(noise_multiplier=1.0))``) or by
    flat names (:meth:`of`); read it by section (``config.privacy.clip_norm``) or flat
    (:meth:`flat`); change it by flat names (:meth:`replace`). ``config_file``: the config file
    this segment was read from (``fsdpx train --config``), recorded only."""

    run: RunSettings = RunSettings()
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    eval: EvalSettings = EvalSettings()
    privacy: PrivacySettings = PrivacySettings()
    parallelism: Layout = Layout()
    offload: OffloadSettings = OffloadSettings()
    checkpoints: CheckpointSettings = CheckpointSettings()
    logging: LoggingSettings = LoggingSettings()
    config_file: str | None = None

    def __post_init__(self) -> None:
        model, layout, offload = self.model, self.parallelism, self.offload.kind
        if self.checkpoints.resume_from is not None and self.checkpoints.ckpt_dir is None:
            ckpt_dir = str(Path(self.logging.out) / self.logging.name / "ckpt")
            _set(self, checkpoints=dataclasses.replace(self.checkpoints, ckpt_dir=ckpt_dir))
        _check_sources(model, self.data, layout)
        if self.eval.enabled and model.kind == "python":
            raise ConfigError("eval_data is read like data_path (a token file or text); model = \"python\" reads"
                              " its examples from data_fn: drop eval_data")
        if layout.tp > 1 and model.kind == "gpt" and model.n_head % layout.tp:
            raise ConfigError(f"n_head={model.n_head} does not divide by tp={layout.tp}: a rank holds whole heads")
        if model.lora is not None:
            _check_lora(self)
        if self.privacy.audit_canaries is not None and (model.lora is not None or self.run.freeze):
            what = "lora" if model.lora is not None else f"freeze = {self.run.freeze!r}"
            raise ConfigError(f"audit_canaries with {what} is not supported: the canaries sit in weights the run"
                              " trains at every step")
        if layout.strategy is not None and self.privacy.private and self.privacy.method == "vmap":
            raise ConfigError("a sharded private run computes norms with method 'ghost' or 'auto', not 'vmap'")

    @classmethod
    def of(cls, **values: Any) -> "RunConfig":
        """The configuration whose settings are ``values`` by flat name (``steps``,
        ``clip_norm``, ``offload_topk``, ...; ``config_file``), the rest defaults. An unknown
        name is a ``TypeError`` naming it, as a dataclass's constructor raises."""
        sections: dict[str, dict[str, Any]] = {s: {} for s in SECTION_TYPES}
        top = {}
        for name, value in values.items():
            if name == "config_file":
                top[name] = value
            elif name in FIELDS:
                section, attribute = FIELDS[name]
                sections[section][attribute] = value
            else:
                raise TypeError(f"RunConfig.of() got an unexpected keyword argument {name!r}")
        built = {s: SECTION_TYPES[s](**v) for s, v in sections.items()}
        return cls(**built, **top)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RunConfig":
        """The configuration a ``config.json`` or a segment's record holds: the tree
        (``dataclasses.asdict``) or, as records written before the tree, flat names. Names this
        version does not know are dropped (a record from a newer version still loads)."""
        flat: dict[str, Any] = {}
        for key, value in values.items():
            if key in SECTION_TYPES and isinstance(value, Mapping):
                flat.update({_flat_name(key, k): v for k, v in value.items()})
            else:
                flat[key] = value
        return cls.of(**{k: v for k, v in flat.items() if k in FIELDS or k == "config_file"})

    def flat(self) -> dict[str, Any]:
        """``{flat name: value}`` of every setting, and ``config_file``."""
        out = {name: getattr(getattr(self, s), a) for name, (s, a) in FIELDS.items()}
        return {**out, "config_file": self.config_file}

    def replace(self, **values: Any) -> "RunConfig":
        """This configuration with ``values`` (flat names) changed, checked anew."""
        return type(self).of(**{**self.flat(), **values})

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.out) / self.logging.name

    def model_config(self) -> GPTConfig:
        """The built-in GPT's config on the embedded corpus's alphabet (the jobs' GPT);
        :func:`fsdpx.train.sources.build_source` sizes it to the run's data."""
        from fsdpx.models.gpt import GPTConfig

        m = self.model
        return GPTConfig(vocab_size=data.VOCAB_SIZE, block_size=self.data.block_size, n_layer=m.n_layer,
                         n_head=m.n_head, n_embd=m.n_embd)


def _check_sources(model: ModelSettings, data_: DataSettings, layout: Layout) -> None:
    """The checks that read the model and the data together."""
    hf = {k: getattr(model, k) for k in ("model_path", "model_class", "model_fields") if getattr(model, k) is not None}
    if model.kind == "gpt" and hf:
        raise ConfigError(f"{', '.join(hf)} describe a transformers model: add model = \"transformers\"")
    if model.kind == "transformers":
        if (model.model_path is None) == (model.model_class is None):
            raise ConfigError("a transformers model needs one of model_path (a local directory holding"
                              " config.json, or the file) and model_class (e.g. \"GPT2Config\")")
        if model.vocab_size is not None:
            raise ConfigError("vocab_size sizes the built-in GPT; a transformers model's vocabulary is its"
                              " config's (model_fields = {vocab_size = ...})")
        if layout.sequence_parallel:
            raise ConfigError("sequence_parallel is for the built-in GPT: transformers' models derive positions"
                              " from the length of the (then split) sequence")
    functions = {k: v for k, v in (("model_fn", model.model_fn), ("data_fn", data_.data_fn),
                                   ("loss_fn", model.loss_fn), ("hparams", model.hparams)) if v is not None}
    if model.kind != "python" and functions:
        raise ConfigError(f"{', '.join(functions)} describe your own functions: add model = \"python\"")
    if model.kind == "python":
        refs = {"model_fn": model.model_fn, "data_fn": data_.data_fn, "loss_fn": model.loss_fn}
        missing = [k for k, v in refs.items() if v is None]
        if missing:
            raise ConfigError(f"model = \"python\" needs model_fn, data_fn and loss_fn (\"module:qualname\");"
                              f" missing {', '.join(missing)}")
        bad = [k for k, v in refs.items() if not _is_ref(v)]
        if bad:
            raise ConfigError(f"{', '.join(bad)} must be \"module:qualname\", got"
                              f" {', '.join(repr(refs[k]) for k in bad)}")
        if model.hparams is not None and not isinstance(model.hparams, dict):
            raise ConfigError(f"hparams must be a table, got {model.hparams!r}")
        given = [k for k in ("data_path", "tokenizer") if getattr(data_, k) is not None]
        given += ["vocab_size"] if model.vocab_size is not None else []
        if given or data_.kind not in ("auto", "python"):
            raise ConfigError(f"model = \"python\" reads its examples from data_fn; drop"
                              f" {', '.join(given) or 'data = ' + repr(data_.kind)}")
        if layout.sequence_parallel:
            raise ConfigError("sequence_parallel is for the built-in GPT")
    elif data_.kind == "python":
        raise ConfigError("data = \"python\" is data_fn's, with model = \"python\"")


def _check_lora(config: RunConfig) -> None:
    """The checks that read ``lora`` with the rest of the run: adapters go on a transformers model
    (peft's), in one process or data-parallel (ddp, ZeRO, HSDP), without offload or a freezing
    schedule of its own (the base weights are frozen by ``lora`` itself)."""
    layout = config.parallelism
    if config.model.kind != "transformers":
        what = {"gpt": "the built-in GPT", "python": "your own model"}[config.model.kind]
        raise ConfigError(f"lora puts peft adapters on a transformers model (model = \"transformers\"), not on {what}")
    if layout.tp > 1 or layout.pp > 1:
        raise ConfigError(f"lora with tensor or pipeline parallelism (tp={layout.tp}, pp={layout.pp}) is not"
                          " supported: the plans cut the base layers peft wraps; use a data-parallel strategy")
    if config.offload.kind != "none":
        raise ConfigError(f"lora with offload = {config.offload.kind!r} is not supported: the adapters' optimizer"
                          " state is small, keep it on the device (offload = \"none\")")
    if config.run.freeze:
        raise ConfigError(f"lora freezes every base weight itself; drop freeze = {config.run.freeze!r}")


def _is_ref(value: Any) -> bool:
    """Whether ``value`` reads as ``"module:qualname"`` (resolved later, by ``fsdpx.train.refs``)."""
    module, sep, qualname = value.partition(":") if isinstance(value, str) else ("", "", "")
    return bool(sep and all(p.isidentifier() for p in [*module.split("."), *qualname.split(".")]))


# --------------------------------------------------------------------------- the config file


class ConfigFileError(ConfigError):
    """A config file that cannot be read as a run: unknown key, wrong section or wrong type."""


COMMAND_KEYS: dict[str, tuple[str, type]] = {"nproc": ("parallelism", int), "max_restarts": ("checkpoints", int),
                                             "progress": ("logging", bool)}
"""Settings of the command, not of the run, that a config file also holds: key -> (section, type)."""

SECTIONS: dict[str, tuple[str, ...]] = {
    s: (*(_flat_name(s, f.name) for f in dataclasses.fields(cls)), *(k for k, (home, _) in COMMAND_KEYS.items()
                                                                      if home == s))
    for s, cls in SECTION_TYPES.items()}
"""Where each key lives (by flat name): the fields of each section's value, then the command's keys."""

_PREFIX = {"checkpoints": "ckpt"}
EXCLUSIVE = {"target_epsilon": ("noise_multiplier",), "noise_multiplier": ("target_epsilon",),
             "batch_size": ("sample_rate",), "sample_rate": ("batch_size",)}
"""A value given for the key clears these when they come from a lower layer (a flag over the file)."""


def short_name(section: str, field: str) -> str:
    """The key of ``field`` in ``section``: ``kind`` for the field named like the section, the
    field without the section's prefix (``offload_topk`` -> ``topk``), else the field."""
    prefix = _PREFIX.get(section, section)
    if field == section:
        return "kind"
    return field[len(prefix) + 1:] if field.startswith(prefix + "_") else field


def _keys(section: str) -> dict[str, str]:
    """Every key ``section`` accepts -> its field (full names and short names)."""
    fields = SECTIONS[section]
    return {**{f: f for f in fields}, **{short_name(section, f): f for f in fields}}


def _home(field: str) -> str | None:
    return next((s for s, fs in SECTIONS.items() if field in fs), None)


def _types() -> dict[str, tuple[type, ...]]:
    """The TOML types each key takes (``float`` fields take integers too)."""
    hints = {_flat_name(s, a): hint for s, cls in SECTION_TYPES.items() for a, hint in typing.get_type_hints(cls).items()}
    hints.update({k: kind for k, (_, kind) in COMMAND_KEYS.items()})
    out = {}
    for name, hint in hints.items():
        kinds = tuple(t for t in (typing.get_args(hint) or (hint,)) if t is not type(None))
        out[name] = tuple(typing.get_origin(t) or t for t in kinds)
    return out


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a table"}


def _typed(value: Any, kinds: tuple[type, ...]) -> Any:
    """``value`` as the field's type, or ``TypeError`` naming what it should be."""
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind in (str, dict) and isinstance(value, kind):
            return value
    raise TypeError(" or ".join(_TYPE_WORDS[k] for k in kinds))


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def parse(doc: Mapping[str, Any], *, where: str = "config",
          checks: Mapping[str, Callable[[Any], Any]] | None = None) -> dict[str, Any]:
    """The values a parsed config document sets: ``{field: value}`` (fields of :class:`RunConfig`
    and the ``COMMAND_KEYS``), only those it names.

    Guarantees: every key is known in its section (else :class:`ConfigFileError` naming the key
    and the closest known one, or the section it belongs in), has its field's type (integers
    are accepted for numbers and converted to float), and passes ``checks[field]`` (the
    command line's own value checks, so a file and a flag refuse the same values with the same
    words); a field set twice (full and short name) is refused. ``where`` prefixes every message.
    Proven by ``tests/test_train_config.py``."""
    types, checks, out = _types(), checks or {}, {}
    top = {k: v for k, v in doc.items() if not isinstance(v, dict) or k not in SECTIONS}
    tables = {k: v for k, v in doc.items() if k in SECTIONS and isinstance(v, dict)}
    for section, table in [("run", top), *tables.items()]:
        keys = _keys(section)
        for key, value in table.items():
            label = f"[{section}] {key}" if section != "run" or key not in top else key
            field = keys.get(key)
            if field is None:
                home = _home(key)
                if home is not None:
                    raise ConfigFileError(f"{where}: {label} belongs in [{home}]")
                if section == "run" and key in SECTIONS:
                    raise ConfigFileError(f"{where}: {key} must be a table: [{key}]")
                if isinstance(value, dict) and section == "run":
                    raise ConfigFileError(f"{where}: unknown section [{key}]{_did_you_mean(key, list(SECTIONS))}")
                raise ConfigFileError(f"{where}: unknown key {label}{_did_you_mean(key, list(keys))}")
            if field in out:
                raise ConfigFileError(f"{where}: {label} sets {field} a second time")
            try:
                value = _typed(value, types[field])
            except TypeError as e:
                raise ConfigFileError(f"{where}: {label} must be {e}, got {value!r}") from None
            if field in checks:
                try:
                    checks[field](value)
                except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                    raise ConfigFileError(f"{where}: {label}: {e}") from None
            out[field] = value
    return out


def read_file(path: str | Path, *, checks: Mapping[str, Callable[[Any], Any]] | None = None) -> dict[str, Any]:
    """:func:`parse` of the TOML file at ``path``; a missing file or bad TOML is a
    :class:`ConfigFileError` naming the file (and the line, from ``tomllib``)."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{path}: not valid TOML: {e}") from None
    return parse(doc, where=str(path), checks=checks)


def merge(file: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a run: the file's, with the flags typed on the command line over them. A
    flag of an exclusive pair (``EXCLUSIVE``: ``--noise-multiplier`` vs ``target_epsilon``,
    ``--sample-rate`` vs ``batch_size``) clears the file's other half, and a flag asking for
    noise (``--target-epsilon``, ``--noise-multiplier``) makes a file's ``private = false``
    private again. Pure; fields neither sets keep :class:`RunConfig`'s defaults."""
    out = dict(file)
    for key in flags:
        for cleared in EXCLUSIVE.get(key, ()):
            out.pop(cleared, None)
        if key in ("target_epsilon", "noise_multiplier") and "private" not in flags:
            out.pop("private", None)
    out.update(flags)
    return out


# --------------------------------------------------------------------------- the resolved file

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                          ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()
                               if v is not None) + "}"
    raise TypeError(f"cannot write {value!r} in TOML")


def _toml_key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key)


def to_toml(config: RunConfig, extra: Mapping[str, Any] | None = None) -> str:
    """``config`` as a config file, one table per section, short names, ``None`` left out
    (``extra``: command keys such as ``nproc``; ``config_file`` goes into a comment). Guarantee:
    ``RunConfig.of(**read_file(f))`` of the written file equals ``config`` but for ``config_file``
    (``tests/test_train_config.py::test_the_resolved_file_reads_back_as_the_same_config``)."""
    values = {**config.flat(), **(extra or {})}
    lines = [f"# fsdpx train --config: the resolved configuration of {config.run_dir}"]
    if config.config_file is not None:
        lines.append(f"# read from {config.config_file}, with the flags typed over it")
    for section, fields in SECTIONS.items():
        body = [f"{short_name(section, f)} = {_toml_value(values[f])}" for f in fields
                if values.get(f) is not None]
        if body:
            lines += ["", f"[{section}]", *body]
    return "\n".join(lines) + "\n"
