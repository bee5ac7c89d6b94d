"""The on-disk format, version 1: a manifest (JSON) and shard files (safetensors layout).

A checkpoint is a directory::

    step_<N>/
      manifest.json            this module's ``Manifest``; written last, its presence = committed
      rank_<r>.safetensors     the boxes written by rank r (absent if r wrote nothing)

``docs/checkpoint-format.md`` is the prose description; this module is the executable one.
Everything here is pure: bytes in, values out (files are opened elsewhere).

Guarantees:
  * ``decode(encode(m)) == m`` for every manifest (``tests/test_ckpt_format.py::
    test_manifest_round_trips``), and ``encode`` is deterministic (sorted keys).
  * ``decode`` never evaluates code: JSON, then ``Spec.parse`` (literals only).
  * ``decode`` raises ``ManifestError`` naming the file for bad JSON, a failed self-checksum, a
    missing or ill-typed field, a box outside its tensor, boxes that do not tile their tensor
    exactly, a box whose byte count disagrees with its dtype, or a box in an unlisted file
    (``tests/test_ckpt_corruption.py::test_edited_manifest_is_a_manifest_error``); a newer
    ``format_version`` raises ``UnsupportedVersionError``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from fsdpx.sharding import Mesh, Spec

from .checksum import ALGORITHM, hex_digest
from .errors import ManifestError, UnsupportedVersionError

FORMAT_NAME = "fsdpx-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

Box = tuple[tuple[int, int], ...]

# torch dtype <-> (manifest name, safetensors code). Raw little-endian bytes in both cases.
DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float64: ("float64", "F64"),
    torch.float32: ("float32", "F32"),
    torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"),
    torch.int64: ("int64", "I64"),
    torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"),
    torch.int8: ("int8", "I8"),
    torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"),
}
_BY_NAME = {name: dt for dt, (name, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; supported: {sorted(_BY_NAME)}")
    return DTYPES[dtype][0]


def dtype_of(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise ValueError(f"unknown dtype {name!r}")
    return _BY_NAME[name]


def itemsize(name: str) -> int:
    return torch.empty((), dtype=dtype_of(name)).element_size()


def box_numel(box: Box) -> int:
    return math.prod(e - s for s, e in box)


@dataclass(frozen=True)
class BoxRecord:
    """One stored block of a tensor: global ``box``, at ``offset`` (absolute, in bytes) of
    ``file``, ``nbytes`` long, C-contiguous, with its own xxh3 ``checksum``."""

    box: Box
    file: str
    offset: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class TensorRecord:
    """A global tensor: shape, dtype name, the spec it was saved with, and its stored boxes
    (each distinct box once, however many ranks held a replica of it)."""

    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    boxes: tuple[BoxRecord, ...]
    param_shape: tuple[int, ...] | None = None  # set when ``shape`` is a view of a parameter of this shape


@dataclass(frozen=True)
class FileRecord:
    """A shard file: the rank that wrote it, its size and its whole-file checksum."""

    rank: int
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    library_version: str
    mesh: Mesh
    strategy: str | None
    files: Mapping[str, FileRecord]
    tensors: Mapping[str, TensorRecord]
    state: Any  # the tagged JSON tree of ckpt.flatten, tensors as {"$tensor": path}
    private: bool
    step: int | None = None
    created_unix: float = field(default=0.0, compare=False)
    format_version: int = FORMAT_VERSION
    plan: Any = None  # the sharding plan's layouts (``ckpt.rules.layout_meta``), when saved with one
    run_id: str | None = None  # the run that wrote it (``CheckpointManager``); retention deletes only its own


# ---- encoding --------------------------------------------------------------------------------


def mesh_to_json(mesh: Mesh) -> list[list[Any]]:
    return [[name, size] for name, size in mesh.shape.items()]


def mesh_from_json(data: Any) -> Mesh:
    return Mesh(**{str(name): int(size) for name, size in data})


def _box_json(b: BoxRecord) -> dict[str, Any]:
    return {"box": [list(se) for se in b.box], "file": b.file, "offset": b.offset, "nbytes": b.nbytes,
            "checksum": b.checksum}


def _body(m: Manifest) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": m.format_version,
        "library_version": m.library_version,
        "checksum_algorithm": ALGORITHM,
        "mesh": mesh_to_json(m.mesh),
        "strategy": m.strategy,
        "step": m.step,
        "private": m.private,
        "created_unix": m.created_unix,
        "files": {name: {"rank": f.rank, "size": f.size, "checksum": f.checksum} for name, f in m.files.items()},
        "tensors": {path: _tensor_json(t) for path, t in m.tensors.items()},
        "state": m.state,
        **({"plan": m.plan} if m.plan is not None else {}),
        **({"run_id": m.run_id} if m.run_id is not None else {}),
    }


def _tensor_json(t: TensorRecord) -> dict[str, Any]:
    out = {"shape": list(t.shape), "dtype": t.dtype, "spec": repr(t.spec), "boxes": [_box_json(b) for b in t.boxes]}
    if t.param_shape is not None:
        out["param_shape"] = list(t.param_shape)
    return out


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(m: Manifest) -> bytes:
    """The manifest file's bytes: the body plus ``manifest_checksum``, the xxh3 of the body's
    canonical JSON (sorted keys, no spaces)."""
    body = _body(m)
    return _canonical({**body, "manifest_checksum": hex_digest(_canonical(body))})


# ---- decoding --------------------------------------------------------------------------------


def _need(cond: bool, path: str, what: str) -> None:
    if not cond:
        raise ManifestError(path, f"manifest does not match the format: {what}")


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_box(raw: Any, path: str, where: str) -> Box:
    ok = isinstance(raw, list) and all(isinstance(se, list) and len(se) == 2 and all(map(_int, se)) for se in raw)
    _need(ok, path, f"{where}: a box must be a list of [start, stop] int pairs")
    return tuple((int(s), int(e)) for s, e in raw)


def _parse_boxes(raw: Any, t_path: str, shape: tuple[int, ...], dtype: str, files: Mapping[str, FileRecord],
                 path: str) -> tuple[BoxRecord, ...]:
    _need(isinstance(raw, list), path, f"tensor {t_path!r}: 'boxes' must be a list")
    out = []
    for b in raw:
        _need(isinstance(b, dict) and {"box", "file", "offset", "nbytes", "checksum"} <= set(b), path,
              f"tensor {t_path!r}: box entries need box, file, offset, nbytes, checksum")
        box = _parse_box(b["box"], path, f"tensor {t_path!r}")
        _need(len(box) == len(shape) and all(0 <= s <= e <= n for (s, e), n in zip(box, shape)), path,
              f"tensor {t_path!r}: box {box} lies outside shape {shape}")
        _need(b["file"] in files, path, f"tensor {t_path!r}: box in unlisted file {b['file']!r}")
        _need(_int(b["offset"]) and _int(b["nbytes"]) and b["offset"] >= 0, path, f"tensor {t_path!r}: bad offset")
        _need(b["nbytes"] == box_numel(box) * itemsize(dtype), path,
              f"tensor {t_path!r}: box {box} of {dtype} needs {box_numel(box) * itemsize(dtype)} bytes, "
              f"manifest says {b['nbytes']}")
        _need(b["offset"] + b["nbytes"] <= files[b["file"]].size, path,
              f"tensor {t_path!r}: box bytes end past the end of {b['file']!r}")
        out.append(BoxRecord(box, b["file"], b["offset"], b["nbytes"], str(b["checksum"])))
    return tuple(out)


def _disjoint(a: Box, b: Box) -> bool:
    return any(min(ea, eb) <= max(sa, sb) for (sa, ea), (sb, eb) in zip(a, b))


def _check_tiling(t_path: str, shape: tuple[int, ...], boxes: tuple[BoxRecord, ...], path: str) -> None:
    """The non-empty boxes must be pairwise disjoint and cover the tensor: then every element
    has exactly one stored value."""
    full = [b.box for b in boxes if box_numel(b.box) > 0]
    covered = sum(box_numel(b) for b in full)
    _need(covered == math.prod(shape), path, f"tensor {t_path!r}: boxes cover {covered} of {math.prod(shape)} elements")
    for i, a in enumerate(full):
        for b in full[i + 1:]:
            _need(len(shape) > 0 and _disjoint(a, b), path, f"tensor {t_path!r}: boxes {a} and {b} overlap")


def _parse_tensor(t_path: str, raw: Any, files: Mapping[str, FileRecord], path: str) -> TensorRecord:
    _need(isinstance(raw, dict) and {"shape", "dtype", "spec", "boxes"} <= set(raw), path,
          f"tensor {t_path!r} needs shape, dtype, spec, boxes")
    _need(isinstance(raw["shape"], list) and all(_int(n) and n >= 0 for n in raw["shape"]), path,
          f"tensor {t_path!r}: bad shape")
    _need(raw["dtype"] in _BY_NAME, path, f"tensor {t_path!r}: unknown dtype {raw['dtype']!r}")
    try:
        spec = Spec.parse(str(raw["spec"]))
    except ValueError as e:
        raise ManifestError(path, f"tensor {t_path!r}: {e}") from None
    shape = tuple(raw["shape"])
    _need(spec.ndim == len(shape), path, f"tensor {t_path!r}: spec {spec} does not fit shape {shape}")
    boxes = _parse_boxes(raw["boxes"], t_path, shape, raw["dtype"], files, path)
    _check_tiling(t_path, shape, boxes, path)
    param_shape = raw.get("param_shape")
    if param_shape is not None:
        _need(isinstance(param_shape, list) and all(_int(n) and n >= 0 for n in param_shape)
              and math.prod(param_shape) == math.prod(shape), path,
              f"tensor {t_path!r}: param_shape {param_shape} is not a view of {list(shape)}")
        param_shape = tuple(param_shape)
    return TensorRecord(shape, raw["dtype"], spec, boxes, param_shape)


def decode(data: bytes, path: str = MANIFEST) -> Manifest:
    """Parse and check a manifest file's bytes (``path`` only names it in errors)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(path, f"not valid JSON ({e})") from None
    _need(isinstance(raw, dict) and raw.get("format") == FORMAT_NAME, path, f"'format' must be {FORMAT_NAME!r}")
    version = raw.get("format_version")
    _need(_int(version), path, "'format_version' must be an int")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(f"{path}: format version {version}, this library reads <= {FORMAT_VERSION}")
    body = {k: v for k, v in raw.items() if k != "manifest_checksum"}
    if raw.get("manifest_checksum") != hex_digest(_canonical(body)):
        raise ManifestError(path, "the manifest's own checksum does not match its content")
    need = {"library_version", "mesh", "strategy", "step", "private", "files", "tensors", "state", "created_unix"}
    _need(need <= set(raw), path, f"missing fields {sorted(need - set(raw))}")
    try:
        mesh = mesh_from_json(raw["mesh"])
    except (TypeError, ValueError) as e:
        raise ManifestError(path, f"bad mesh ({e})") from None
    _need(isinstance(raw["files"], dict), path, "'files' must be an object")
    files = {}
    for name, f in raw["files"].items():
        _need(isinstance(f, dict) and _int(f.get("rank")) and _int(f.get("size")) and isinstance(f.get("checksum"), str),
              path, f"file {name!r} needs rank, size, checksum")
        _need("/" not in name and name not in ("", ".", "..", MANIFEST), path, f"bad file name {name!r}")
        files[name] = FileRecord(f["rank"], f["size"], f["checksum"])
    _need(isinstance(raw["tensors"], dict), path, "'tensors' must be an object")
    tensors = {t_path: _parse_tensor(t_path, t, files, path) for t_path, t in raw["tensors"].items()}
    _need(raw.get("run_id") is None or isinstance(raw["run_id"], str), path, "'run_id' must be a string")
    return Manifest(
        library_version=str(raw["library_version"]), mesh=mesh, strategy=raw["strategy"], files=files,
        tensors=tensors, state=raw["state"], private=bool(raw["private"]), step=raw["step"],
        created_unix=float(raw["created_unix"]), format_version=version, plan=raw.get("plan"),
        run_id=raw.get("run_id"),
    )
