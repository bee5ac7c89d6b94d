"""The configuration of a run: :class:`RunConfig`, and the ``--config`` file that fills it.

    config = RunConfig(steps=300, target_epsilon=8.0)          # from Python
    values = read_file("run.toml")                             # {field: value}, checked
    print(to_toml(config))                                     # the resolved file, loadable again

A config file is TOML with one table per concern; a key is a :class:`RunConfig` field (or, in
its section, the field's short name: ``[model] kind`` is ``model``, ``[offload] topk`` is
``offload_topk``, ``[checkpoints] every`` is ``ckpt_every``), and every key is also a flag of
``fsdpx train`` (``--offload-topk``). Keys before the first table belong to ``[run]``::

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
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from fsdpx.models.gpt import GPTConfig
from fsdpx.sharding import strategies

from . import data
from .budget import MAX_NOISE_MULTIPLIER

MODEL_KINDS = ("gpt", "transformers", "python")
DATA_KINDS = ("auto", "corpus", "text", "npy", "bin", "dataset", "python")
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int16", "int32", "int64")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A run was configured with values that cannot work together; the message says which."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on. The defaults are the ~2 minute demo of ``fsdpx train``.

    Noise: ``noise_multiplier`` when given, otherwise the smallest one that spends at most
    ``target_epsilon`` over ``steps``. Batches: Poisson with ``sample_rate`` when given,
    otherwise with rate ``batch_size / num_examples`` (``batch_size`` is the EXPECTED size).
    The field that is not used is set to ``None``, so ``config.json`` shows only what the run
    used. ``private=False`` runs plain training on the same batches (both noise fields None).
    Inconsistent values raise :class:`ConfigError`."""

    name: str = "private"
    out: str = "runs"
    steps: int = 300
    seed: int = 0
    # where the model, optimizer state and each step's batch live (fsdpx.train.device): "cpu", "cuda"
    # (cuda:LOCAL_RANK under torchrun, NCCL between processes) or "auto" (cuda when there is a GPU per
    # process). Default cpu: a run does not change with the machine it lands on. Asked anew by every
    # segment: a checkpoint written on a GPU resumes on the CPU and back.
    device: str = "cpu"
    # model
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    # the model (fsdpx.train.sources): "gpt", the built-in GPT above (vocabulary ``vocab_size``, default
    # the data's), or "transformers": ``model_path`` (a local directory holding config.json, or the
    # file) or ``model_class`` (a transformers config or causal-LM class name), ``model_fields`` set on
    # its config; never downloaded, initialised from ``seed``
    model: str = "gpt"
    model_path: str | None = None
    model_class: str | None = None
    model_fields: dict | None = dataclasses.field(default=None, hash=False)
    vocab_size: int | None = None
    # or "python": your own functions, each named "module:qualname" (fsdpx.train.refs) and imported by every
    # process: ``model_fn(hparams) -> nn.Module`` (called with the torch RNG seeded by ``seed``),
    # ``data_fn(hparams) -> (inputs, targets)`` (the whole dataset, its first dimension the examples; seeded
    # likewise) and ``loss_fn(model output, targets) -> (B,)`` per-example losses; ``hparams`` (a table of
    # JSON values) is passed to the three
    model_fn: str | None = None
    data_fn: str | None = None
    loss_fn: str | None = None
    hparams: dict | None = dataclasses.field(default=None, hash=False)
    # data
    corpus_chars: int = data.DEFAULT_CHARS
    # the data (fsdpx.train.sources): "corpus" (the embedded one) or a file at ``data_path``: "text"
    # (tokenised by ``tokenizer``: "bytes" or a local tokenizer directory), "npy" / "bin" (token ids;
    # a .bin is raw ``data_dtype``), "dataset" (``datasets.load_from_disk``: ``data_column`` of
    # ``data_split``); "auto" reads the kind off the path
    data: str = "auto"
    data_path: str | None = None
    tokenizer: str | None = None
    data_dtype: str = "uint16"
    data_column: str | None = None
    data_split: str = "train"
    # optimizer
    lr: float = 1e-2
    # freezing (fsdpx.optim.Freezing.parse): "wte,wpe@0-100;lm_head@50-" freezes names (parameters,
    # tied aliases or modules) for steps start <= t < stop; frozen ones get no gradient, norm, noise
    # or update, and their optimizer state is kept as it is
    freeze: str | None = None
    # privacy
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
    # PLD discretization: coarser is faster and still an upper bound on epsilon. At the default
    # run 1e-2 reports 8.008 where 1e-4 reports 8.001, and composes 300 steps in 0.3 s, not 15 s.
    accounting_interval: float = 1e-2
    # sharding: None = one process; else a strategy of fsdpx.sharding.strategies run by every rank that
    # torchrun started (``fsdpx train --nproc N --strategy S`` launches torchrun itself)
    strategy: str | None = None
    # tensor parallelism: the GPT plan (fsdpx.models.tp_plans.gpt_plan) over a ``tp`` axis of this
    # size; the strategy shards the rest over ``world / tp`` data-parallel ranks
    tp: int = 1
    sequence_parallel: bool = False  # with tp: activations between regions split along the sequence
    # pipeline parallelism: the GPT's blocks cut into pp * virtual_stages stages over a ``pp`` axis of
    # this size (fsdpx.sharding.pipeline), run by ``schedule`` on ``microbatches`` per data-parallel rank
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    # checkpoints: every ``ckpt_every`` steps into ``ckpt_dir`` (async, atomic, keep the last 3);
    # ``resume`` continues from the newest intact one (same noise, batches and accountant)
    # optimizer offload: "none", "zenflow" (selected columns every step, the rest on the host
    # every ``offload_interval`` steps) or "zero" (ZeRO-Offload: all optimizer state on the host)
    offload: str = "none"
    offload_topk: float = 0.1
    offload_interval: int = 4
    ckpt_dir: str | None = None
    ckpt_every: int = 50
    resume: bool = False
    # segments (fsdpx.train.resume): ``resume_from`` branches from any intact checkpoint (a
    # ``step_<N>`` directory or a root) into this run's own directory and checkpoint root
    # (default ``<out>/<name>/ckpt``); the flags below loosen what a resume refuses by default
    resume_from: str | None = None
    allow_budget_increase: bool = False
    allow_new_data: bool = False
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER
    # the config file this segment was read from (``fsdpx train --config``), recorded only
    config_file: str | None = None

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None or not self.private:
            object.__setattr__(self, "target_epsilon", None)
        if not self.private:
            object.__setattr__(self, "noise_multiplier", None)
        if self.sample_rate is not None:
            object.__setattr__(self, "batch_size", None)
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if min(self.n_layer, self.n_head, self.n_embd, self.block_size) < 1:
            raise ConfigError("n_layer, n_head, n_embd and block_size must all be >= 1")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.batch_size is None and self.sample_rate is None:
            raise ConfigError("give batch_size (expected batch size) or sample_rate")
        if self.batch_size is not None and not self.batch_size > 0:
            raise ConfigError(f"batch_size must be > 0, got {self.batch_size}")
        if self.private and self.target_epsilon is None and self.noise_multiplier is None:
            raise ConfigError("a private run needs target_epsilon or noise_multiplier")
        if self.private and self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ConfigError(f"target_epsilon must be > 0, got {self.target_epsilon}")
        if self.offload not in ("none", "zenflow", "zero"):
            raise ConfigError(f"offload must be none, zenflow or zero, got {self.offload!r}")
        if self.freeze and self.offload != "none":
            raise ConfigError("freeze with offload is not supported: the offloaded optimizer's state is not kept"
                              " per parameter")
        if self.freeze:
            from fsdpx.optim.freezing import Freezing

            try:
                Freezing.parse(self.freeze)
            except ValueError as err:
                raise ConfigError(f"freeze {self.freeze!r}: {err}") from None
        if self.resume and self.ckpt_dir is None:
            raise ConfigError("resume needs ckpt_dir")
        if self.resume and self.resume_from is not None:
            raise ConfigError("give resume (the newest checkpoint of ckpt_dir) or resume_from (a branch), not both")
        if self.resume_from is not None and self.ckpt_dir is None:
            object.__setattr__(self, "ckpt_dir", str(Path(self.out) / self.name / "ckpt"))
        if not (self.max_noise_multiplier > 0 and math.isfinite(self.max_noise_multiplier)):
            raise ConfigError(f"max_noise_multiplier must be finite and > 0, got {self.max_noise_multiplier}")
        if self.ckpt_every < 1:
            raise ConfigError(f"ckpt_every must be >= 1, got {self.ckpt_every}")
        if self.strategy is not None and self.strategy not in strategies.ALL:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of {sorted(strategies.ALL)}")
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.tp > 1 and self.strategy is None:
            raise ConfigError("tp needs a strategy: tensor parallelism runs on several processes")
        self._check_sources()
        if self.tp > 1 and self.model == "gpt" and self.n_head % self.tp:
            raise ConfigError(f"n_head={self.n_head} does not divide by tp={self.tp}: a rank holds whole heads")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1: it splits the sequence over the tensor-parallel ranks")
        if self.tp > 1 and self.offload != "none":
            raise ConfigError("offload with tensor parallelism is not supported yet")
        if self.pp < 1 or self.microbatches < 1 or self.virtual_stages < 1:
            raise ConfigError("pp, microbatches and virtual_stages must all be >= 1")
        if self.pp > 1 and self.strategy is None:
            raise ConfigError("pp needs a strategy: pipeline stages run on several processes")
        if self.pp * self.virtual_stages > self.n_layer and self.pp > 1 and self.model == "gpt":
            raise ConfigError(f"pp={self.pp} x virtual_stages={self.virtual_stages} stages but only"
                              f" n_layer={self.n_layer} blocks: every stage needs a block")
        if self.pp > 1 and self.offload != "none":
            raise ConfigError("offload with pipeline parallelism is not supported yet")
        if self.pp > 1 and self.sequence_parallel:
            raise ConfigError("sequence parallelism with a pipeline is not supported yet")
        if self.strategy is not None and self.private and self.method == "vmap":
            raise ConfigError("a sharded private run computes norms with method 'ghost' or 'auto', not 'vmap'")

    def _check_sources(self) -> None:
        if self.model not in MODEL_KINDS:
            raise ConfigError(f"model must be one of {MODEL_KINDS}, got {self.model!r}")
        hf = {k: getattr(self, k) for k in ("model_path", "model_class", "model_fields")
              if getattr(self, k) is not None}
        if self.model == "gpt" and hf:
            raise ConfigError(f"{', '.join(hf)} describe a transformers model: add model = \"transformers\"")
        if self.model == "transformers":
            if (self.model_path is None) == (self.model_class is None):
                raise ConfigError("a transformers model needs one of model_path (a local directory holding"
                                  " config.json, or the file) and model_class (e.g. \"GPT2Config\")")
            if self.vocab_size is not None:
                raise ConfigError("vocab_size sizes the built-in GPT; a transformers model's vocabulary is its"
                                  " config's (model_fields = {vocab_size = ...})")
            if self.sequence_parallel:
                raise ConfigError("sequence_parallel is for the built-in GPT: transformers' models derive positions"
                                  " from the length of the (then split) sequence")
        functions = {k: getattr(self, k) for k in ("model_fn", "data_fn", "loss_fn", "hparams")
                     if getattr(self, k) is not None}
        if self.model != "python" and functions:
            raise ConfigError(f"{', '.join(functions)} describe your own functions: add model = \"python\"")
        if self.model == "python":
            missing = [k for k in ("model_fn", "data_fn", "loss_fn") if getattr(self, k) is None]
            if missing:
                raise ConfigError(f"model = \"python\" needs model_fn, data_fn and loss_fn (\"module:qualname\");"
                                  f" missing {', '.join(missing)}")
            bad = [k for k in ("model_fn", "data_fn", "loss_fn") if not _is_ref(getattr(self, k))]
            if bad:
                raise ConfigError(f"{', '.join(bad)} must be \"module:qualname\", got"
                                  f" {', '.join(repr(getattr(self, k)) for k in bad)}")
            if self.hparams is not None and not isinstance(self.hparams, dict):
                raise ConfigError(f"hparams must be a table, got {self.hparams!r}")
            given = [k for k in ("data_path", "tokenizer", "vocab_size") if getattr(self, k) is not None]
            if given or self.data not in ("auto", "python"):
                raise ConfigError(f"model = \"python\" reads its examples from data_fn; drop"
                                  f" {', '.join(given) or 'data = ' + repr(self.data)}")
            if self.sequence_parallel:
                raise ConfigError("sequence_parallel is for the built-in GPT")
        elif self.data == "python":
            raise ConfigError("data = \"python\" is data_fn's, with model = \"python\"")
        if self.model_fields is not None and not isinstance(self.model_fields, dict):
            raise ConfigError(f"model_fields must be a table of config fields, got {self.model_fields!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.data not in DATA_KINDS:
            raise ConfigError(f"data must be one of {DATA_KINDS}, got {self.data!r}")
        if self.data not in ("auto", "corpus") and self.data_path is None:
            raise ConfigError(f"data = {self.data!r} needs data_path")
        if self.data == "corpus" and self.data_path is not None:
            raise ConfigError("data = \"corpus\" is the embedded corpus: drop data_path or set data to its kind")
        if self.data_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"data_dtype must be one of {TOKEN_DTYPES}, got {self.data_dtype!r}")

    @property
    def run_dir(self) -> Path:
        return Path(self.out) / self.name

    def model_config(self) -> GPTConfig:
        """The built-in GPT's config on the embedded corpus's alphabet (the jobs' GPT);
        :func:`fsdpx.train.sources.build_source` sizes it to the run's data."""
        return GPTConfig(vocab_size=data.VOCAB_SIZE, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)



def _is_ref(value: Any) -> bool:
    """Whether ``value`` reads as ``"module:qualname"`` (resolved later, by ``fsdpx.train.refs``)."""
    module, sep, qualname = value.partition(":") if isinstance(value, str) else ("", "", "")
    return bool(sep and all(p.isidentifier() for p in [*module.split("."), *qualname.split(".")]))


# --------------------------------------------------------------------------- the config file


class ConfigFileError(ConfigError):
    """A config file that cannot be read as a run: unknown key, wrong section or wrong type."""


SECTIONS: dict[str, tuple[str, ...]] = {
    "run": ("steps", "seed", "lr", "freeze", "device"),
    "model": ("model", "model_path", "model_class", "model_fields", "vocab_size", "n_layer", "n_head", "n_embd",
              "model_fn", "loss_fn", "hparams"),
    "data": ("data", "data_path", "data_fn", "tokenizer", "data_dtype", "data_column", "data_split", "block_size",
             "corpus_chars"),
    "privacy": ("private", "target_epsilon", "noise_multiplier", "delta", "clip_norm", "batch_size", "sample_rate",
                "method", "clipping", "epsilon_budget", "accountant", "accounting_interval", "max_noise_multiplier"),
    "parallelism": ("strategy", "nproc", "tp", "sequence_parallel", "pp", "schedule", "microbatches",
                    "virtual_stages"),
    "offload": ("offload", "offload_topk", "offload_interval"),
    "checkpoints": ("ckpt_dir", "ckpt_every", "resume", "resume_from", "allow_budget_increase", "allow_new_data",
                    "max_restarts"),
    "logging": ("name", "out", "progress"),
}
"""Where each key lives. ``nproc``, ``max_restarts`` and ``progress`` are settings of the command, not
of the run."""

COMMAND_KEYS: dict[str, type] = {"nproc": int, "progress": bool, "max_restarts": int}
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
    hints = typing.get_type_hints(RunConfig)
    out = {}
    for name, hint in {**hints, **COMMAND_KEYS}.items():
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
    ``RunConfig(**read_file(f))`` of the written file equals ``config`` but for ``config_file``
    (``tests/test_train_config.py::test_the_resolved_file_reads_back_as_the_same_config``)."""
    values = {**dataclasses.asdict(config), **(extra or {})}
    lines = [f"# fsdpx train --config: the resolved configuration of {config.run_dir}"]
    if config.config_file is not None:
        lines.append(f"# read from {config.config_file}, with the flags typed over it")
    for section, fields in SECTIONS.items():
        body = [f"{short_name(section, f)} = {_toml_value(values[f])}" for f in fields
                if values.get(f) is not None]
        if body:
            lines += ["", f"[{section}]", *body]
    return "\n".join(lines) + "\n"
