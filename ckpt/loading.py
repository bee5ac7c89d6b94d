"""``load``: one rank's local state, in ANY mesh and strategy, reading only its byte ranges.

    state = ckpt.load("ckpt/step_100", mesh=Mesh(dp=2), strategy=zero2(), rank=dist.get_rank())

For every tensor of the manifest the target spec comes from ``ckpt.rules`` (the strategy or
sharding plan you load with, or ``specs``), the global shape from the manifest (or the plan's
view of the parameter: a tensor stored in one view and loaded in another is read whole and
re-cut), and the rank's box from
``fsdpx.sharding.layout.local_box``; ``ckpt.reader`` reads the overlapping stored bytes. Non-tensor state
comes from the manifest's JSON tree. Tensors come back on the CPU, as plain tensors; with
``like`` (a state of the same kind, e.g. the fresh state of the run resuming), each on the device
of ``like``'s tensor at the same path, the others on the CPU: a GPU run's parameters and moments
go to its GPU while an offloaded optimizer's host state stays on the host.

Guarantees:
  * Every returned tensor equals ``fsdpx.shard(global, target_spec, mesh)[rank]`` bit for bit,
    for any saved and target (spec, mesh) (``property_tests/test_ckpt_properties.py::
    test_any_save_layout_loads_into_any_layout``), and a rank reads only the bytes it needs
    (same test, ``stats``).
  * Nothing is unpickled: JSON, ``Spec.parse`` (literals) and raw bytes only.
  * Before reading data: a missing or resized shard file raises ``MissingShardError`` /
    ``TruncatedShardError`` naming it; ``expected_shapes`` ({path: global shape}) that differ
    from the checkpoint raise ``ShapeMismatchError`` naming the tensor
    (``tests/test_ckpt_resume.py::test_refuses_a_model_with_other_shapes``).
  * A private checkpoint (saved with ``private=True``) or ``private=True`` here requires an
    ``Accountant`` in the state, whose step count equals the state's top-level ``step`` when
    both exist; else ``MissingAccountantError`` (``test_refuses_private_resume_without_accountant``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import unquote

from fsdpx.sharding import Mesh
from fsdpx.sharding.layout import local_box

from . import format as fmt
from .errors import LayoutError, ManifestError, MissingAccountantError, MissingShardError, ShapeMismatchError, TruncatedShardError
from .flatten import contains_type, flatten, top_level, unflatten
from .reader import Files, ReadStats, read_box
from .rules import Layouts, Specs, make_rule


def read_manifest(directory: str | Path, stats: ReadStats | None = None) -> fmt.Manifest:
    path = Path(directory) / fmt.MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(str(path), "no manifest: not a committed checkpoint") from None
    if stats is not None:
        stats.metadata_bytes += len(data)
    return fmt.decode(data, str(path))


def check_files_present(directory: Path, manifest: fmt.Manifest) -> None:
    """Every listed shard file exists with its recorded size (a cheap ``stat`` each)."""
    for name, rec in manifest.files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise MissingShardError(str(path), "shard file listed in the manifest is missing") from None
        if size != rec.size:
            raise TruncatedShardError(str(path), f"has {size} bytes, the manifest recorded {rec.size}")


def check_shapes(manifest: fmt.Manifest, expected: Mapping[str, Sequence[int]]) -> None:
    """Each expected path exists with that global shape, and the checkpoint has no other tensor
    under the same top-level keys (a model with fewer tensors does not match either)."""
    for path, shape in expected.items():
        if path not in manifest.tensors:
            raise ShapeMismatchError(f"{path}: expected shape {tuple(shape)}, the checkpoint has no such tensor")
        rec = manifest.tensors[path]
        if tuple(shape) not in (rec.shape, rec.param_shape):  # a parameter may be stored in a view of its shape
            raise ShapeMismatchError(f"{path}: expected shape {tuple(shape)}, the checkpoint has {rec.shape}")
    tops = {p.split("/", 1)[0] for p in expected}
    extra = sorted(p for p in manifest.tensors if p.split("/", 1)[0] in tops and p not in expected)
    if extra:
        raise ShapeMismatchError(f"{extra[0]}: the checkpoint has this tensor, the model does not ({len(extra)} such)")


def check_private(manifest: fmt.Manifest, private: bool) -> None:
    if not (private or manifest.private):
        return
    if not contains_type(manifest.state, "Accountant"):
        raise MissingAccountantError("this is a private run but the checkpoint holds no Accountant: resuming would "
                                     "restart the privacy ledger at zero and silently break the guarantee")
    fields = top_level(manifest.state)
    acc, step = fields.get("accountant"), fields.get("step")
    if isinstance(acc, dict) and acc.get("$type") == "Accountant" and isinstance(step, int):
        steps = unflatten(acc, _no_tensor).steps
        if steps != step:
            raise MissingAccountantError(f"the accountant records {steps} steps but the state is at step {step}: "
                                         "the ledger does not belong to this state")


def _no_tensor(path: str) -> Any:
    raise ManifestError(path, "an Accountant cannot hold tensors")


def load(
    directory: str | Path,
    *,
    mesh: Mesh,
    strategy: Layouts,
    rank: int = 0,
    specs: Specs = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
    private: bool = False,
    verify: bool = True,
    stats: ReadStats | None = None,
    like: Any = None,
) -> Any:
    """Rank ``rank``'s local state from the checkpoint ``directory`` (see module doc); with
    ``like``, each tensor on the device of ``like``'s tensor at its path (others on the CPU)."""
    directory = Path(directory)
    stats = stats if stats is not None else ReadStats()
    manifest = read_manifest(directory, stats)
    check_files_present(directory, manifest)
    if expected_shapes is not None:
        check_shapes(manifest, expected_shapes)
    check_private(manifest, private)
    rule = make_rule(strategy, specs)
    files = Files(directory, {name: f.size for name, f in manifest.files.items()})
    tensors = {}
    try:
        for path, rec in manifest.tensors.items():
            if not rule.held(path, mesh, rank):
                continue  # another pipeline stage's parameter
            shape = rule.target_shape(path, rec.shape, rec.param_shape)
            spec = rule(path, len(shape))
            try:
                box = local_box(shape, spec, mesh, rank)
            except ValueError as e:
                raise LayoutError(f"{path}: cannot lay out {shape} as {spec} on {mesh}: {e}") from None
            if shape == rec.shape:
                tensors[path] = read_box(rec, box, files, stats, verify=verify)
            else:  # another view of the same parameter: re-cut the whole stored tensor
                whole = read_box(rec, tuple((0, n) for n in rec.shape), files, stats, verify=verify)
                block = whole.reshape(shape)[tuple(slice(a, b) for a, b in box)]
                tensors[path] = block.clone()
    finally:
        files.close()
    place = {} if like is None else {p: t.device for p, t in flatten(like)[1].items()}
    return unflatten(_prune(manifest.state, tensors), lambda p: tensors[p].to(place[p]) if p in place else tensors[p])


def _prune(tree: Any, tensors: Mapping[str, Any]) -> Any:
    """The tree without the dict entries of tensors this rank does not hold (another pipeline
    stage's parameters: ``Rule.held``)."""
    if isinstance(tree, list):
        return [_prune(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"$dict"}:
            return {"$dict": [[k, _prune(v, tensors)] for k, v in tree["$dict"]
                              if not (isinstance(v, dict) and set(v) == {"$tensor"} and v["$tensor"] not in tensors)]}
        return {k: _prune(v, tensors) for k, v in tree.items()}
    return tree


def read_whole(directory: str | Path, under: str, *, verify: bool = True) -> Iterator[tuple[str, Any]]:
    """Each tensor of the checkpoint ``directory`` below the dict ``under`` of the state (e.g.
    ``"params"``), whole, one at a time: ``(its key in that dict, the tensor)``, in the view of the
    parameter it was saved from (``param_shape``), on the CPU. Reads the tensors' bytes and
    nothing else (no other part of the state, e.g. no optimizer moment), whatever layout wrote
    them; every stored box is read whole, so checked against its checksum.

    Guarantees: each tensor equals the global tensor that was saved, bit for bit, in any saving
    layout (``tests/test_export.py``, which exports a ZeRO-3 and a tensor-parallel checkpoint)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files_present(directory, manifest)
    files = Files(directory, {name: f.size for name, f in manifest.files.items()})
    stats = ReadStats()
    try:
        for path, rec in manifest.tensors.items():
            top, _, key = path.partition("/")
            if top != under or not key or "/" in key:
                continue
            whole = read_box(rec, tuple((0, n) for n in rec.shape), files, stats, verify=verify)
            yield unquote(key), whole.reshape(rec.param_shape) if rec.param_shape is not None else whole
    finally:
        files.close()


def load_ranks(directory: str | Path, *, mesh: Mesh, strategy: Layouts, specs: Specs = None,
               stats: list[ReadStats] | None = None, **kwargs: Any) -> list[Any]:
    """``load`` for every rank of a simulated mesh: entry r is rank r's local state."""
    stats = stats if stats is not None else [ReadStats() for _ in range(mesh.size)]
    return [load(directory, mesh=mesh, strategy=strategy, rank=r, specs=specs, stats=stats[r], **kwargs)
            for r in range(mesh.size)]
