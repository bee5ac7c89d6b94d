"""What a run trains, built from its :class:`RunConfig`: the model, its per-example loss and the
examples. :func:`build_source` is the one place ``fsdpx train`` turns a configuration into them.

    source = build_source(RunConfig.of(model="transformers", model_path="examples/tiny-gpt2",
                                       data_path="notes.txt", tokenizer="bytes"))
    source.model, source.params, source.loss_fn, source.inputs, source.targets

Models: the built-in GPT (``fsdpx.models.gpt``, its vocabulary the data's unless ``vocab_size``
is given), or a transformers causal LM from a local config (a directory holding
``config.json``, or the file) or from a class name and fields. Nothing is downloaded. A model
directory holding a transformers save (``model.safetensors``, or the shards of
``model.safetensors.index.json``) starts from its weights (:mod:`fsdpx.train.pretrained`: built
with its parameters on ``meta``, nothing drawn from the seed, every key checked by name, stored
bf16/fp16 cast to fp32); a pickled ``pytorch_model.bin`` alone is refused by name; otherwise
weights are initialised from ``seed``. The model goes in unmodified (``use_cache`` off: training
needs no key/value cache).

Data: a token stream cut into examples by :func:`fsdpx.train.data.windows` (``block_size + 1``
tokens each, the targets shifted by one), from the embedded corpus, a text file (tokenised by
bytes or by a tokenizer from a local directory), a ``.npy`` array or raw ``.bin`` file of token
ids, or a ``datasets`` dataset saved with ``save_to_disk`` (an ``input_ids`` column, or a text
column whose rows are joined by newlines and tokenised like a text file). A ``.npy`` or ``.bin``
file is memory-mapped as stored (uint16, uint32, ...): its examples are cut on demand
(:class:`fsdpx.train.data.Windows`), only a step's batch made int64, so a file larger than memory
trains, and nothing reads it whole before the first step: each batch's ids are checked against
the model's vocabulary as it is read (a bad id is a :class:`VocabularyError` at that step, naming
the file and the id's offset), its digest (:func:`fsdpx.train.segments.data_digest`) is hashed by
a background thread after the first step; only the built-in GPT without ``vocab_size`` reads it once first, chunk by
chunk, for the largest id (its vocabulary). A dataset's column of token ids is read the
same way through Arrow's memory map (:class:`fsdpx.train.data.ChunkedStream`); text (a file, or a
dataset's text column) is tokenised and held in memory as int64.

Refused by name (:class:`ConfigError`), before anything runs: a path that does not exist, a
token id the model's vocabulary does not cover (:class:`VocabularyError`; a mapped file's: at the
step that reads it), examples longer than
the model's positions and no example at all. (A tensor-parallel run of a model without a plan is
refused by :mod:`fsdpx.train.parallel`.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.runtime import global_rng

from . import data
from .data import VocabularyError
from .config import RunConfig
from .errors import ConfigError
from .pretrained import Weights, check_keys, find_weights, load_buffers, load_into, parameters_on_meta

LORA_STREAM = 1 << 20  # lora_A's seed is the run's plus this: draws of their own, a function of the seed

Encode = Callable[[str], Sequence[int]]
Decode = Callable[[Sequence[int]], str]


class Tokens(NamedTuple):
    """A token stream and how to read it. ``vocab_size``: the tokenizer's (``None`` for token
    files read without one); ``encode``/``decode``: ``None`` without a tokenizer."""

    ids: Tensor | np.ndarray | data.ChunkedStream  # (L,): int64 in memory, a token file mapped as stored
    # (np.memmap), or a dataset's token-ids column in Arrow's memory map
    vocab_size: int | None
    encode: Encode | None
    decode: Decode | None
    description: str


class Source(NamedTuple):
    """What a run trains: ``model`` with its initial ``params`` (a function of the seed),
    ``loss_fn(model output, targets) -> (B,)``, the examples ``inputs``/``targets``
    ``(N, block_size)`` int64 (tensors, or for a mapped token file :class:`fsdpx.train.data.Windows`
    cut on demand: index them by rows, as :func:`privacy.step.sample_batch` does), the tokenizer
    (``encode``/``decode``, or ``None``), and a line each describing the model and the data."""

    model: nn.Module
    params: dict[str, Tensor]
    loss_fn: Callable[[Any, Tensor], Tensor]
    inputs: Tensor | data.Windows
    targets: Tensor | data.Windows
    encode: Encode | None
    decode: Decode | None
    model_name: str
    description: str
    language_model: bool = True  # a causal LM over token ids: its text can be sampled
    weights: Weights | None = None  # the pretrained weights the parameters come from, if any

    def to(self, device: torch.device) -> "Source":
        """This source with the model (parameters and buffers) and ``params`` on ``device``; the
        examples stay on the host (each step's batch is moved as it is taken). On the CPU it is
        this very source: nothing is copied. Parameters on ``meta`` (a rank that reads its blocks
        of pretrained weights, :func:`read_mode`) stay there; the buffers move."""
        tensors = [t for t in [*self.model.parameters(), *self.model.buffers()] if not t.is_meta]
        if all(t.device == device for t in tensors):
            return self
        if any(p.is_meta for p in self.model.parameters()):
            for module in self.model.modules():
                for key, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[key] = buf.to(device)
            return self
        self.model.to(device)
        params = {k: v.detach() for k, v in self.model.named_parameters()}
        return self._replace(params=params)

    @property
    def vocab_size(self) -> int | None:
        """The token embedding's size; None for a model without one (``model = "python"``)."""
        emb = input_embedding(self.model)
        return emb.num_embeddings if emb is not None else None


def read_mode(config: RunConfig, sharded: bool) -> str:
    """How a process reads a model's pretrained weights (:func:`build_source`'s ``read``): one
    process reads them whole; a sharded rank reads only its blocks (``"blocks"``: a pipeline
    rank its stages' parameters, its slices of them), except under ``lora``, whose layers rename
    the base weights (``"whole"``: each rank reads the base once, then keeps its shard)."""
    return "blocks" if sharded and config.model.lora is None else "whole"


def build_source(config: RunConfig, *, read: str = "whole") -> Source:
    """The model, loss and examples ``config`` describes.

    Pretrained weights (a ``model_path`` directory holding safetensors) are read as ``read``
    says: ``"whole"``, every tensor into the model; ``"blocks"`` or ``"none"``, nothing: the
    parameters (and ``params``) stay on ``meta`` with their keys checked, for a sharded rank
    that reads its blocks (:func:`fsdpx.train.build.build_step`) or a check before torchrun.

    Guarantees: a pure function of ``config`` (and the files it names): the same parameters and
    examples on every rank and every call, the global torch RNG left as it was. With the default
    data and model (the embedded corpus, the built-in GPT) the examples and parameters are those
    of ``data.make_examples`` and ``GPT(config.model_config())`` seeded by ``config.run.seed``, so
    runs and checkpoints from before config files continue bit for bit. Every token id is below
    the model's vocabulary size (else :class:`VocabularyError`). Proven by
    ``tests/test_train_config.py``. ``model = "python"``: :func:`python_source`."""
    if config.model.kind == "python":
        return python_source(config)
    tokens = build_tokens(config)
    block = config.data.block_size
    if isinstance(tokens.ids, Tensor):
        low, top = data.id_range(tokens.ids)
        cut = data.windows
    else:  # a mapped file: never read whole before the first step (its digest hashed in the background)
        shape = (max(len(tokens.ids) - 1, 0) // block, block)
        # the built-in GPT's vocabulary is the data's unless given: one pass of plain reads for its range
        derived = config.model.kind == "gpt" and not config.model.vocab_size and tokens.vocab_size is None
        low, top = data.id_range(tokens.ids) if derived else (0, -1)
        digest = data.BackgroundDigest(tokens.ids, shape[0] * block + 1, str(shape))
        cut = functools.partial(data.mapped_windows, digest=digest, where=tokens.description)
    if low < 0:
        raise ConfigError(f"{tokens.description}: token ids must be >= 0, found {low}")
    vocab = config.model.vocab_size or tokens.vocab_size or top + 1
    model, weights = build_model(config, vocab, read=read)
    check_vocabulary(model, top, tokens.description)
    check_positions(model, config.data.block_size)
    if isinstance(tokens.ids, Tensor):
        inputs, targets = cut(tokens.ids, block)
    else:  # every batch read is checked against the model's vocabulary (VocabularyError naming the offset)
        inputs, targets = cut(tokens.ids, block, vocab=input_embedding(model).num_embeddings)
    if inputs.shape[0] < 1:
        raise ConfigError(f"{tokens.description}: {len(tokens.ids)} tokens give no example of block_size"
                          f" {config.data.block_size} (each needs block_size + 1 tokens)")
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss_fn = token_loss if isinstance(model, GPT) else lm_loss
    name = model_name(model) + (f" ({weights.describe()})" if weights is not None else "")
    return Source(model, params, loss_fn, inputs, targets, tokens.encode, tokens.decode, name, tokens.description,
                  weights=weights)


def python_source(config: RunConfig) -> Source:
    """The source of your own functions (``model = "python"``): ``model_fn(hparams)`` and
    ``data_fn(hparams)`` each called with the torch RNG seeded by ``config.run.seed`` (the global RNG
    restored), ``loss_fn`` as it is.

    Guarantees: every process calling it with one ``config`` builds the same parameters and
    examples (the functions imported by reference, :func:`fsdpx.train.refs.resolve_ref`, and
    seeded alike, so a ``torch.randn`` in them draws the same everywhere), provided the functions
    depend on nothing but ``hparams`` and the torch RNG. Refused by name (:class:`ConfigError`):
    a reference that does not import, a model that is no ``nn.Module``, data that is not two
    tensors of the same number (>= 1) of examples."""
    from .refs import resolve_ref

    refs = (config.model.model_fn, config.data.data_fn, config.model.loss_fn)
    model_fn, data_fn, loss_fn = (resolve_ref(r) for r in refs)
    hparams = dict(config.model.hparams or {})
    with seeded(config.run.seed):
        model = model_fn(hparams)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model_fn {config.model.model_fn} returned {type(model).__name__}, not a torch.nn.Module")
    with seeded(config.run.seed):
        examples = data_fn(hparams)
    if not (isinstance(examples, (tuple, list)) and len(examples) == 2
            and all(isinstance(t, Tensor) for t in examples)):
        raise ConfigError(f"data_fn {config.data.data_fn} must return (inputs, targets), two tensors")
    inputs, targets = examples
    if inputs.ndim < 1 or inputs.shape[0] < 1 or targets.ndim < 1 or targets.shape[0] != inputs.shape[0]:
        raise ConfigError(f"data_fn {config.data.data_fn}: inputs {tuple(inputs.shape)} and targets"
                          f" {tuple(targets.shape)} need the same number (>= 1) of examples along the first dimension")
    params = {k: v.detach() for k, v in model.named_parameters()}
    return Source(model, params, loss_fn, inputs, targets, None, None,
                  f"{type(model).__name__} ({config.model.model_fn})", f"{config.data.data_fn}: {inputs.shape[0]} examples",
                  language_model=False)


# --------------------------------------------------------------------------- models

@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Inside: torch's global RNG seeded with ``seed`` and drawn from by this thread alone; after:
    the RNG as it was (:func:`fsdpx.runtime.global_rng.exclusive`). Module initialisation draws
    from the process-wide generator, so two runs building their models at once (ranks run as
    threads) interleaved their draws and built different parameters
    (``tests/test_train_config.py::test_runs_building_their_models_at_once_get_the_same_parameters``)."""
    with global_rng.exclusive(seed):
        yield


def build_model(config: RunConfig, vocab_size: int, *, read: str = "whole") -> tuple[nn.Module, Weights | None]:
    """The model of ``config`` and the pretrained weights it starts from (``None``: initialised
    from ``config.run.seed``, the global RNG restored): the built-in GPT with ``vocab_size``
    entries, or the transformers causal LM it names. Pretrained weights (:func:`build_source`'s
    ``read``) are checked key by key before anything is read (``WeightKeysError``). With
    ``lora``, peft's adapters are put on the model once its base weights are loaded
    (:func:`fsdpx.train.lora_model.inject_lora`, ``lora_A`` drawn from ``seed + LORA_STREAM``,
    ``lora_B`` zero: step 0 computes what the base model does)."""
    model, weights = _base_model(config, vocab_size, read=read)
    lora = config.model.lora
    if lora is not None:
        from .lora_model import inject_lora

        path = config.model.model_path
        with seeded(config.run.seed + LORA_STREAM):  # not the draws a base initialised from the seed began with
            inject_lora(model, lora, base=str(Path(path).resolve()) if path else config.model.model_class)
    return model, weights


def _base_model(config: RunConfig, vocab_size: int, *, read: str) -> tuple[nn.Module, Weights | None]:
    with seeded(config.run.seed):
        if config.model.kind == "gpt":
            m = config.model
            return GPT(GPTConfig(vocab_size=vocab_size, block_size=config.data.block_size, n_layer=m.n_layer,
                                 n_head=m.n_head, n_embd=m.n_embd)), None
        path = config.model.model_path
        weights = find_weights(Path(path)) if path is not None else None
        if weights is None:
            return _transformers_model(config), None
        with parameters_on_meta():
            model = _transformers_model(config).float()  # fp32 whatever the saved dtype: the file is cast
    check_keys(model, weights)
    if read == "whole":
        load_into(model, weights)
    else:
        load_buffers(model, weights)
    return model, weights


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model = \"transformers\" needs the transformers package (pip install transformers)") \
            from None
    return transformers


def _transformers_model(config: RunConfig) -> nn.Module:
    tf = _transformers()
    fields = dict(config.model.model_fields or {})
    model_class = None
    if config.model.model_path is not None:
        path = Path(config.model.model_path)
        if not (path.is_file() or (path / "config.json").is_file()):
            raise ConfigError(f"model_path {path}: no config.json there (a local directory holding one, or the"
                              " file; nothing is downloaded)")
        try:
            hf_config = tf.AutoConfig.from_pretrained(str(path), local_files_only=True, **fields)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model_path {path}: not a transformers config: {e}") from None
    else:
        cls = getattr(tf, config.model.model_class, None)
        if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel):
            model_class, cls = cls, cls.config_class
        if not (isinstance(cls, type) and issubclass(cls, tf.PretrainedConfig)):
            raise ConfigError(f"model_class {config.model.model_class!r} is neither a transformers config class (e.g."
                              " GPT2Config) nor a model class (e.g. GPT2LMHeadModel)")
        try:
            hf_config = cls(**fields)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model_class {config.model.model_class} with fields {fields}: {e}") from None
    hf_config.use_cache = False  # a training forward needs no key/value cache in its output
    try:
        return model_class(hf_config) if model_class else tf.AutoModelForCausalLM.from_config(hf_config)
    except ValueError as e:
        raise ConfigError(f"{type(hf_config).__name__} has no causal-LM model in transformers: {e}") from None


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token embedding of the built-in GPT or of a transformers model; None for a model
    that has none."""
    if isinstance(model, GPT):
        return model.wte
    get = getattr(model, "get_input_embeddings", None)
    return get() if get is not None else None


def model_name(model: nn.Module) -> str:
    if isinstance(model, GPT):
        return f"GPT {model.config.n_layer}x{model.config.n_embd}"
    return type(model).__name__


def check_vocabulary(model: nn.Module, top: int, description: str) -> None:
    """Raise :class:`VocabularyError` if token id ``top`` (the data's largest) is not below the
    model's vocabulary size."""
    size = input_embedding(model).num_embeddings
    if top >= size:
        raise VocabularyError(f"{description} holds token id {top}, but the model's vocabulary has {size} ids"
                              f" (0..{size - 1}): give the model a vocab_size of at least {top + 1}")


def check_positions(model: nn.Module, block_size: int) -> None:
    """Raise :class:`ConfigError` if examples of ``block_size`` tokens exceed the model's
    positions (``n_positions`` / ``max_position_embeddings`` of a transformers config)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(model, GPT) and limit is not None and block_size > limit:
        raise ConfigError(f"block_size {block_size} exceeds the model's {limit} positions")


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    """Per-example loss ``(B,)`` of a causal LM's output (``out.logits``, or the logits
    themselves): the mean next-token cross-entropy over each example's targets
    (:func:`fsdpx.models.gpt.token_loss`)."""
    return token_loss(out if isinstance(out, Tensor) else out.logits, targets)


# --------------------------------------------------------------------------- data


def data_kind(config: RunConfig) -> str:
    """``config.data.kind``, or for ``"auto"`` the kind read off ``data_path``: none -> the corpus,
    ``.npy``, ``.bin``, a directory -> a saved dataset, any other file -> text."""
    if config.data.kind != "auto":
        return config.data.kind
    if config.data.data_path is None:
        return "corpus"
    path = Path(config.data.data_path)
    if path.suffix in (".npy", ".bin"):
        return path.suffix[1:]
    return "dataset" if path.is_dir() else "text"


def build_tokens(config: RunConfig) -> Tokens:
    """The run's token stream (see the module doc); :class:`ConfigError` for a missing path or
    a file that is not what its kind says."""
    kind = data_kind(config)
    if kind == "corpus":
        text = data.corpus(config.data.corpus_chars)
        if config.data.tokenizer is None:  # the character alphabet: the examples of data.make_examples
            return Tokens(data.encode(text), data.VOCAB_SIZE, data.encode, data.decode,
                          f"the embedded corpus ({config.data.corpus_chars} characters)")
        return _tokenize(text, config.data.tokenizer, f"the embedded corpus ({config.data.corpus_chars} characters)")
    path = Path(config.data.data_path)
    if not path.exists():
        raise ConfigError(f"data_path {path} does not exist")
    if kind == "text":
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError) as e:
            raise ConfigError(f"data_path {path} is not a UTF-8 text file: {e}") from None
        return _tokenize(text, config.data.tokenizer or "bytes", f"text {path}")
    if kind == "dataset":
        return _dataset_tokens(config, path)
    ids = _token_file(path, kind, config.data.data_dtype)
    tokenizer = config.data.tokenizer
    encode, decode, vocab, how = _tokenizer(tokenizer) if tokenizer else (None, None, None, None)
    return Tokens(ids, vocab, encode, decode, f"{kind} {path}" + (f", read by {how}" if how else ""))


def _token_file(path: Path, kind: str, dtype: str) -> np.ndarray:
    """The token ids of a ``.npy`` array (1-D, integer) or a raw ``.bin`` of ``dtype``, mapped
    read-only as stored (nothing read yet)."""
    if kind == "npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ConfigError(f"data_path {path} is not a .npy array: {e}") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ConfigError(f"data_path {path}: a token array must be 1-D of integers, got shape"
                              f" {array.shape} of {array.dtype}")
    else:
        size = path.stat().st_size
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise ConfigError(f"data_path {path}: {size} bytes are not a whole number of {dtype} tokens")
        # np.memmap cannot map an empty file; an empty stream is refused later (no example)
        array = np.memmap(path, dtype=np.dtype(dtype), mode="r") if size else np.zeros(0, np.dtype(dtype))
    return array


def _dataset_tokens(config: RunConfig, path: Path) -> Tokens:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data = \"dataset\" needs the datasets package (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data_path {path} is not a dataset saved with save_to_disk: {e}") from None
    where = f"dataset {path}"
    if isinstance(ds, datasets.DatasetDict):
        if config.data.data_split not in ds:
            raise ConfigError(f"{where} has splits {sorted(ds)}, not data_split {config.data.data_split!r}")
        ds, where = ds[config.data.data_split], f"{where} [{config.data.data_split}]"
    column = config.data.data_column or next((c for c in ("input_ids", "text") if c in ds.column_names), None)
    if column not in ds.column_names:
        raise ConfigError(f"{where} has columns {ds.column_names}: set data_column to the text or token ids")
    where = f"{where}, column {column}"
    tokenizer = config.data.tokenizer
    pieces = _id_pieces(ds, column)
    if pieces is not None:  # token ids read through Arrow's memory map, never listed
        encode, decode, vocab, how = _tokenizer(tokenizer) if tokenizer else (None, None, None, None)
        return Tokens(data.ChunkedStream(pieces), vocab, encode, decode, where + (f", read by {how}" if how else ""))
    rows = list(ds[column])
    if all(isinstance(r, str) for r in rows):
        return _tokenize("\n".join(rows), config.data.tokenizer or "bytes", where)
    try:
        ids = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"{where}: rows must be strings or lists of token ids") from None
    encode, decode, vocab, how = _tokenizer(tokenizer) if tokenizer else (None, None, None, None)
    return Tokens(ids, vocab, encode, decode, where + (f", read by {how}" if how else ""))


def _id_pieces(ds: Any, column: str) -> list[np.ndarray] | None:
    """The rows of a saved dataset's column of integer lists, joined, as zero-copy numpy views of
    its memory-mapped Arrow buffers (one per record batch); ``None`` for any other column (text,
    nulls, an indices mapping), which is read the old way."""
    import pyarrow as pa

    table = getattr(ds.data, "table", ds.data)
    if getattr(ds, "_indices", None) is not None or not isinstance(table, pa.Table):
        return None
    values = table.column(column)
    kind = values.type
    if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)):
        return None
    pieces = []
    for chunk in values.chunks:
        flat = chunk.flatten()
        if chunk.null_count or flat.null_count:
            return None
        pieces.append(flat.to_numpy(zero_copy_only=True))
    return pieces


def _tokenize(text: str, spec: str, where: str) -> Tokens:
    encode, decode, vocab, how = _tokenizer(spec)
    return Tokens(torch.tensor(encode(text), dtype=torch.int64), vocab, encode, decode, f"{where}, {how}")


def decode_known(decode: Decode, size: int, ids: Sequence[int]) -> str:
    """``decode`` of each run of ids below ``size`` (the tokenizer's), every other id written as
    U+FFFD (:data:`fsdpx.train.data.UNKNOWN`): a model whose vocabulary is larger than its
    tokenizer's samples such ids, and its sample must not fail the run."""
    runs = itertools.groupby((int(i) for i in ids), key=lambda i: 0 <= i < size)
    return "".join(decode(run) if known else data.UNKNOWN * len(run) for known, run in
                   ((k, list(g)) for k, g in runs))


def _decode_bytes(ids: Sequence[int]) -> str:
    return decode_known(lambda run: bytes(run).decode("utf-8", "replace"), 256, ids)


def _tokenizer(spec: str) -> tuple[Encode, Decode, int, str]:
    """``(encode, decode, vocab_size, description)`` of ``"bytes"`` (UTF-8 bytes, ids 0..255)
    or a tokenizer saved in a local directory (``AutoTokenizer``; never downloaded)."""
    if spec == "bytes":
        return (lambda s: list(s.encode("utf-8")), _decode_bytes, 256, "bytes")
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(f"tokenizer {spec!r}: give \"bytes\" or a local directory holding a saved tokenizer"
                          " (nothing is downloaded)")
    tf = _transformers()
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"tokenizer {path}: cannot be loaded: {e}") from None

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    return encode, (lambda ids: decode_known(tok.decode, len(tok), ids)), len(tok), f"tokenizer {path}"


# --------------------------------------------------------------------------- sampling


def sample_text(source: Source, params: dict[str, Tensor], num_tokens: int, *, seed: int,
                prompt: str = "The ") -> str:
    """``prompt`` (or, without a tokenizer, the first data token) followed by ``num_tokens``
    tokens sampled from the model at temperature 1, decoded (without a tokenizer: the ids).
    A pure function of ``(params, prompt, num_tokens, seed)``; ``""`` for a source that is no
    language model (``model = "python"``). The sample never fails a finished run: ids the
    tokenizer does not know (a vocabulary larger than the data's alphabet) are written U+FFFD,
    and a model that cannot be sampled gives ``"(no sample: why)"``
    (``tests/test_pretrained_weights.py::test_a_vocabulary_larger_than_the_alphabet_samples_and_finishes``)."""
    if not source.language_model:
        return ""
    try:
        return _sample(source, params, num_tokens, seed=seed, prompt=prompt)
    except (RuntimeError, ValueError, IndexError, TypeError, AttributeError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"(no sample: {type(err).__name__}: {why[:200]})"


def _sample(source: Source, params: dict[str, Tensor], num_tokens: int, *, seed: int, prompt: str) -> str:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.as_tensor(list(source.encode(prompt)) if source.encode else [], dtype=torch.int64)
    if ids.numel() == 0:
        ids = source.inputs[0, :1].clone()  # a Windows reads one row
    block = source.inputs.shape[1]
    # the model's device (its buffers'; parameters may be on meta); tokens are drawn on the host
    device = next((t.device for t in [*source.model.parameters(), *source.model.buffers()] if not t.is_meta),
                  next(iter(params.values())).device)
    params = {k: v.to(device) for k, v in params.items()}
    with torch.no_grad():
        for _ in range(num_tokens):
            out = functional_call(source.model, params, (ids[-block:].unsqueeze(0).to(device),))  # (1, T, V)
            logits = (out if isinstance(out, Tensor) else out.logits)[0, -1].cpu()  # (V,)
            ids = torch.cat([ids, torch.multinomial(logits.float().softmax(-1), 1, generator=gen)])
    return source.decode(ids.tolist()) if source.decode else " ".join(map(str, ids.tolist()))
