"""Pretrained weights: a transformers save (``save_pretrained``) read into a model built without
its random init, whole or one rank's blocks at a time.

    weights = find_weights(Path("my-model"))          # None: a directory of config.json alone
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    check_keys(model, weights)                        # named missing / unexpected / misshapen keys
    load_into(model, weights)                         # every parameter read whole, cast to fp32
    block = read_block(weights, "transformer.h.0.attn.c_attn.weight", box)   # one rank's slice

Files: ``model.safetensors``, or the shards a ``model.safetensors.index.json`` maps. A pickled
``pytorch_model.bin`` alone is refused by name (:class:`PickleWeightsError`): unpickling runs
code, and safetensors reads a slice without reading the tensor. Names are the model's
``state_dict`` names, as ``save_pretrained`` writes them, or the base model's (without the
``base_model_prefix``: the hub's ``gpt2`` holds ``h.0.attn.c_attn.weight``, not
``transformer.h.0...``); a tied parameter (GPT-2's ``lm_head`` on ``wte``) is found under any of
its names, so a file without the tied head is complete. Tensors the model's class says to
ignore (``_keys_to_ignore_on_load_unexpected``: GPT-2's old ``attn.bias`` masks) are skipped.
Stored in another floating dtype (bf16, fp16, fp64) a tensor is cast to the model's (fp32).
Persistent buffers the file holds are read too; the others keep what the model's build computed
(Llama's rotary frequencies): parameters alone are built on ``meta``, buffers are real.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from .errors import ConfigError

SAFETENSORS, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
SHOWN = 3  # keys named in an error before "and N more"

Box = Sequence[tuple[int, int]]


class PickleWeightsError(ConfigError):
    """A model directory holds pickled weights (``pytorch_model.bin``) and no safetensors."""


class WeightKeysError(ConfigError):
    """The file's tensors and the model's parameters do not match (missing, unexpected, or of
    another shape)."""


class Weights(NamedTuple):
    """The tensors of a safetensors save, by name: the file holding each, its shape and its
    stored dtype (safetensors' string, e.g. ``"BF16"``). Nothing but the headers is read."""

    path: Path
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    def describe(self) -> str:
        """A few words: where the weights come from, and the stored dtypes cast to fp32 if any
        (``"weights of my-llama, BF16 cast to fp32"``)."""
        cast = sorted({d for d in self.dtypes.values() if d != "F32"} & {"BF16", "F16", "F64"})
        return f"weights of {self.path}" + (f", {'/'.join(cast)} cast to fp32" if cast else "")


def find_weights(path: Path) -> Weights | None:
    """The safetensors weights of the model directory ``path``; ``None`` when it holds none (a
    ``config.json`` alone, or ``path`` a config file: the model is initialised from the seed).

    Raises :class:`PickleWeightsError` (one line, naming the file and how to convert it) for a
    ``pytorch_model.bin`` without safetensors, and :class:`ConfigError` for an index naming a
    shard that is not there or a file safetensors cannot read. Reads headers only
    (``tests/test_pretrained_weights.py::test_pickled_weights_are_refused_by_name``)."""
    if not path.is_dir():
        return None
    index, single = path / INDEX, path / SAFETENSORS
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"model_path {path}: {INDEX} has no weight_map: {e}") from None
        shards = {name: path / file for name, file in weight_map.items()}
    elif single.is_file():
        shards = None
    else:
        pickled = [p for p in PICKLED if (path / p).is_file()]
        if pickled:
            raise PickleWeightsError(
                f"model_path {path}: {pickled[0]} is pickled weights, which fsdpx does not load (unpickling runs"
                " code); convert it: transformers.AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(dir, safe_serialization=True)")
        return None
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for file in sorted(set(shards.values())) if shards is not None else [single]:
        if not file.is_file():
            raise ConfigError(f"model_path {path}: {INDEX} names {file.name}, which is not there")
        for name, (shape, dtype) in _header(file).items():
            if shards is None or shards.get(name) == file:
                files[name], shapes[name], dtypes[name] = file, shape, dtype
    return Weights(path, files, shapes, dtypes)


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{file}: not a safetensors file: {e}") from None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers is put on ``meta`` (no storage; its init runs
    on meta and draws nothing from torch's generator); buffers are built as usual, so values the
    build computes (rotary frequencies, masks) stay real. Only this thread's builds are affected;
    two such builds at once are serialised by the caller (the sources' ``seeded`` holds
    :func:`fsdpx.runtime.global_rng.exclusive`).
    Proven by ``tests/test_pretrained_weights.py::test_a_meta_build_draws_nothing``."""
    original, owner = nn.Module.register_parameter, threading.get_ident()

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and threading.get_ident() == owner:  # other threads: as usual
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def parameter_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter's canonical name (``named_parameters()``) and every name it goes by (a
    tied parameter has several; the canonical one first; then each without the model's
    ``base_model_prefix``, as a base model's save names it)."""
    names: dict[int, list[str]] = {}
    for alias, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(alias)
    return {aliases[0]: tuple(aliases) + tuple(_unprefixed(model, aliases)) for aliases in names.values()}


def _unprefixed(model: nn.Module, names: Sequence[str]) -> list[str]:
    prefix = getattr(model, "base_model_prefix", "") or ""
    return [n[len(prefix) + 1:] for n in names if prefix and n.startswith(prefix + ".")]


def file_names(model: nn.Module, weights: Weights) -> dict[str, str]:
    """``{canonical parameter name: its name in the file}`` (a tied parameter under whichever of
    its names the file holds) for every parameter the file holds."""
    return {canonical: next(a for a in aliases if a in weights.files)
            for canonical, aliases in parameter_names(model).items() if any(a in weights.files for a in aliases)}


def _listed(keys: Sequence[str]) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def check_keys(model: nn.Module, weights: Weights) -> None:
    """Raise :class:`WeightKeysError` unless every parameter of ``model`` is in ``weights`` (under
    one of its names: a tied head absent from the file is fine) with its shape, and every tensor
    of the file is a parameter or a persistent buffer of ``model``. The error names at most
    three keys of each kind, then "and N more"
    (``tests/test_pretrained_weights.py::test_a_missing_and_an_unexpected_key_are_named``)."""
    names = parameter_names(model)
    found = file_names(model, weights)
    missing = [c for c in names if c not in found]
    buffers = [n for n in model.state_dict(keep_vars=True) if n not in dict(model.named_parameters(
        remove_duplicate=False))]
    known = {a for aliases in names.values() for a in aliases} | set(buffers) | set(_unprefixed(model, buffers))
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = [n for n in weights.files if n not in known and not any(p.search(n) for p in ignored)]
    params = dict(model.named_parameters())
    misshapen = [f"{k} (file {list(weights.shapes[f])}, model {list(params[k].shape)})" for k, f in found.items()
                 if weights.shapes[f] != tuple(params[k].shape)]
    problems = [f"{len(v)} {what}: {_listed(v)}" for what, v in
                (("missing from the file", missing), ("in the file but not in the model", unexpected),
                 ("of another shape", misshapen)) if v]
    if problems:
        raise WeightKeysError(f"model_path {weights.path}: {type(model).__name__}'s parameters and the file's tensors"
                              f" differ: {'; '.join(problems)}")


STORED_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
"""Bytes per element of safetensors' stored dtypes (the others, 8-bit and bool: 1)."""


class ReadLog:
    """What one process read of a save's parameters: the file's tensors it read a block of and
    the bytes of those blocks as stored (a block read twice counts twice), against ``of_tensors``
    and ``of_bytes``, the parameters' tensors in the file and their bytes.
    Proven by ``tests/test_pipeline_weights.py::test_a_pipeline_rank_reads_only_its_stages``."""

    def __init__(self, weights: Weights, names: Sequence[str]):
        self.weights, self.tensors, self.nbytes = weights, set(), 0
        self.of_tensors = len(set(names))
        self.of_bytes = sum(self.stored_bytes(n, None) for n in set(names))

    def stored_bytes(self, name: str, box: Box | None) -> int:
        """The bytes of the block ``box`` (``None``: the whole) of the file's tensor ``name``."""
        shape = [b - a for a, b in box] if box is not None else self.weights.shapes[name]
        return math.prod(shape) * STORED_BYTES.get(self.weights.dtypes[name], 1)

    def add(self, name: str, box: Box | None) -> None:
        self.tensors.add(name)
        self.nbytes += self.stored_bytes(name, box)

    def counts(self) -> dict[str, int]:
        """``{"tensors": ..., "bytes": ...}`` read so far (a plain value: it crosses processes)."""
        return {"tensors": len(self.tensors), "bytes": self.nbytes}


def read_block(weights: Weights, name: str, box: Box | None = None, *, dtype: torch.dtype = torch.float32,
               fused: tuple[int, int] | None = None) -> Tensor:
    """The block ``box`` (per dim ``[start, stop)``; ``None``: the whole tensor) of the file's
    tensor ``name``, cast to ``dtype``, read with safetensors' ``get_slice``: only the block's
    bytes (one run of rows per read) are read. With ``fused=(d, groups)`` the box is of the VIEW
    that splits dim ``d`` into ``(groups, n / groups)`` (``fsdpx.sharding.plan.ParamLayout``)
    and the block has the view's dims: one read per group the box spans.

    Guarantees: equals ``whole.view(view_shape)[box].to(dtype)`` bit for bit
    (``tests/test_pretrained_weights.py::test_read_blocks_equal_blocks_of_the_whole_tensor``),
    and owns its bytes and no more: safetensors hands out views into the file's memory map, which
    would keep a rank's block tied to the whole tensor's mapping (resident bytes the rank does
    not hold, and weights that change or fault if the file is rewritten while the run goes on;
    ``test_a_block_owns_its_bytes_and_not_the_file_s``). An empty box gives an empty tensor of
    the block's shape."""
    from safetensors import safe_open

    shape = weights.shapes[name]
    with safe_open(str(weights.files[name]), framework="pt") as f:
        part = f.get_slice(name)
        if box is None:
            return _owned(part[tuple(slice(0, n) for n in shape)] if shape else f.get_tensor(name), dtype)
        out = torch.empty([b - a for a, b in box], dtype=dtype)
        if out.numel() == 0:  # an empty block (a trailing rank's chunk): nothing to read
            return out
        if fused is None:
            return _owned(part[tuple(slice(a, b) for a, b in box)], dtype)
        d, groups = fused
        within = shape[d] // groups
        (g0, g1), (w0, w1) = box[d], box[d + 1]
        for g in range(g0, g1):
            rows = slice(g * within + w0, g * within + w1)
            index = tuple(slice(a, b) for a, b in box[:d]) + (rows,) + tuple(slice(a, b) for a, b in box[d + 2:])
            out.select(d, g - g0).copy_(part[index])
        return out


def _owned(block: Tensor, dtype: torch.dtype) -> Tensor:
    """``block`` cast to ``dtype`` in memory of its own (a copy when the cast makes none)."""
    cast = block.to(dtype)
    return cast.clone() if cast.data_ptr() == block.data_ptr() else cast


def load_into(model: nn.Module, weights: Weights) -> None:
    """Give every parameter of ``model`` (built by :func:`parameters_on_meta`, or real) the
    file's values, read whole and cast to the parameter's dtype, on the host; tied parameters
    stay tied (one tensor). Persistent buffers the file holds are copied in. Call
    :func:`check_keys` first.

    Guarantees: ``model``'s parameters equal the file's tensors cast to their dtype, bit for
    bit (``tests/test_pretrained_weights.py::test_a_run_with_lr_0_keeps_the_saved_weights``)."""
    found = file_names(model, weights)
    loaded: dict[int, nn.Parameter] = {}
    for canonical, p in model.named_parameters():
        tensor = read_block(weights, found[canonical], dtype=p.dtype)
        loaded[id(p)] = nn.Parameter(tensor, requires_grad=p.requires_grad)
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in loaded:
                module._parameters[key] = loaded[id(p)]
    load_buffers(model, weights)


def load_buffers(model: nn.Module, weights: Weights) -> None:
    """Copy into ``model``'s persistent buffers the values the file holds for them (the others
    keep what the build computed)."""
    persistent = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        stored = next((n for n in [name, *_unprefixed(model, [name])] if n in weights.files), None)
        if stored is not None and name in persistent:
            buf.copy_(read_block(weights, stored, dtype=buf.dtype))
