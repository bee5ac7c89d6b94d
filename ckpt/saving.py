"""``save``: every rank writes its own blocks, rank 0 commits once all are durable.

    handle = ckpt.save("ckpt/step_100", state, mesh=Mesh(dp=4), strategy=zero3(),
                       coordinator=TorchDistCoordinator(), blocking=False)
    ...                                 # keep training; the state was copied already
    handle.wait()                       # the committed path, or the writer's error

What each rank passes: its OWN local state (the tensors it holds) and the same mesh, strategy
and non-tensor values as every other rank. Each tensor's spec comes from ``ckpt.rules`` (the
strategy, overridable by ``specs``); its global shape is inferred from all ranks' local shapes
at commit time, so no rank needs to know it. ``save_ranks`` runs the same protocol for a
simulated mesh: one thread per rank, each with its entry of ``states``.

Protocol (``ckpt.commit`` for the filesystem side): rank 0 creates the temporary directory and
broadcasts it; every rank writes and fsyncs ``rank_<r>.safetensors`` with the blocks it is the
first replica of; ranks gather their reports (or errors) on rank 0; rank 0 checks that the
reports fit one layout, writes the manifest and renames; the outcome is broadcast, so every
rank returns the same path or raises ``SaveError``.

Guarantees:
  * Atomic and never in place: see ``ckpt.commit`` (``tests/test_ckpt_commit.py``).
  * A failure on any rank (e.g. a full disk) commits nothing, removes the temporary directory
    and raises on every rank; earlier checkpoints are untouched
    (``tests/test_ckpt_failures.py::test_full_disk_raises_and_keeps_earlier_checkpoints``).
  * Each distinct box is written once (``tests/test_ckpt_save_load.py::
    test_replicated_tensors_are_written_once``).
  * ``private=True`` refuses a state without an ``Accountant`` (``MissingAccountantError``) and
    marks the manifest private, so ``load`` will insist on the ledger too.
  * Non-tensor state must be identical on all ranks (``LayoutError`` naming the rank otherwise):
    rank-local values must be tensors.

Edge cases: a rank holding no block to write creates no file; zero-size tensors are recorded
with no box; an unsupported dtype or leaf raises before anything is written (on the rank that
has it; give every rank the same structure or the others wait for ``timeout``).
"""

from __future__ import annotations

import threading
import time
import warnings
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import Tensor

from fsdpx.sharding import Mesh, Spec
from fsdpx.sharding.layout import local_box

from . import commit
from . import format as fmt
from .async_save import SaveHandle, saver_for
from .boxes import global_shape, is_writer
from .coordinator import Coordinator, SingleProcess, ThreadGroup
from .errors import LayoutError, MissingAccountantError, SaveError
from .flatten import Tree, contains_type, flatten
from .rules import Layouts, Rule, Specs, layout_meta, make_rule, pipeline_holders, pipeline_meta
from .writer import file_name, write_shard

_SINGLE = SingleProcess()


def library_version() -> str:
    try:
        return metadata.version("fsdpx")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


def save(
    directory: str | Path,
    state: Any,
    *,
    mesh: Mesh,
    strategy: Layouts,
    coordinator: Coordinator | None = None,
    specs: Specs = None,
    private: bool = False,
    step: int | None = None,
    blocking: bool = True,
    on_commit: Callable[[Path], None] | None = None,
    run_id: str | None = None,
) -> SaveHandle:
    """Save this rank's ``state`` into the new checkpoint ``directory`` (see module doc).

    ``on_commit(path)`` runs on rank 0 right after a successful commit (the manager's
    retention); its errors are warnings, never a failed save. ``run_id`` (rank 0's counts) is
    recorded in the manifest: the run that wrote the checkpoint, which retention checks. Returns a ``SaveHandle``; with
    ``blocking=True`` it is already complete (errors were raised)."""
    coordinator = coordinator if coordinator is not None else _SINGLE
    if coordinator.world != mesh.size:
        raise ValueError(f"{mesh} has {mesh.size} ranks but the coordinator has {coordinator.world}")
    rule = make_rule(strategy, specs)
    meta = {"strategy": None if strategy is None else strategy.name, "private": private, "step": step,
            "plan": layout_meta(strategy), "run_id": run_id}

    saver = saver_for(coordinator)

    def make_job() -> Callable[[], Path]:
        tree, tensors = flatten(state)
        if private and not contains_type(tree, "Accountant"):
            raise MissingAccountantError("private=True but the state holds no Accountant: its privacy ledger would be lost")
        if not blocking:
            tensors = saver.snapshot(tensors)
        return partial(_save_rank, Path(directory), tree, tensors, rule, mesh, coordinator, meta, on_commit)

    handle = saver.run(make_job, blocking=blocking)
    if blocking:
        handle.wait()
    return handle


def save_ranks(directory: str | Path, states: Sequence[Any], *, mesh: Mesh, strategy: Layouts,
               specs: Specs = None, private: bool = False, step: int | None = None) -> Path:
    """``save`` for a simulated mesh: ``states[r]`` is rank r's local state. Blocking."""
    if len(states) != mesh.size:
        raise ValueError(f"{mesh} has {mesh.size} ranks, got {len(states)} states")
    group = ThreadGroup(mesh.size)
    results: list[Any] = [None] * mesh.size

    def run(r: int) -> None:
        try:
            results[r] = save(directory, states[r], mesh=mesh, strategy=strategy, coordinator=group.member(r),
                              specs=specs, private=private, step=step).wait()
        except BaseException as e:
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results[0]


# ---- one rank's side of the protocol -----------------------------------------------------------


def _save_rank(directory: Path, tree: Tree, tensors: dict[str, Tensor], rule: Rule, mesh: Mesh,
               coord: Coordinator, meta: dict, on_commit: Callable[[Path], None] | None) -> Path:
    rank = coord.rank
    local_error: BaseException | None = None
    msg: dict = {}
    if rank == 0:
        try:
            msg = {"tmp": str(commit.prepare(directory))}
        except Exception as e:
            local_error, msg = e, {"error": f"rank 0: {e}"}
    msg = coord.broadcast(msg)
    if "error" in msg:
        raise local_error or SaveError(msg["error"])
    tmp = Path(msg["tmp"])

    try:
        report = rank_report(tmp, rank, tree, tensors, rule, mesh)
    except Exception as e:
        local_error, report = e, {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    reports = coord.gather(report)

    decision: dict = {}
    if rank == 0:
        try:
            decision = _decide(reports, tmp, directory, mesh, meta, on_commit)
        except Exception as e:
            commit.abort(tmp)
            local_error, decision = e, {"error": f"rank 0: {type(e).__name__}: {e}"}
    decision = coord.broadcast(decision)
    if "error" in decision:
        raise SaveError(f"checkpoint {directory} not saved: {decision['error']}") from local_error
    return Path(decision["path"])


def _decide(reports: list[dict], tmp: Path, directory: Path, mesh: Mesh, meta: dict,
            on_commit: Callable[[Path], None] | None) -> dict:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        commit.abort(tmp)
        return {"error": "; ".join(errors)}
    manifest = assemble(reports, mesh, **meta)
    path = commit.commit(tmp, directory, fmt.encode(manifest))
    if on_commit is not None:
        try:
            on_commit(path)
        except Exception as e:  # retention must never turn a committed save into a failure
            warnings.warn(f"after committing {path}: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)
    return {"path": str(path)}


def rank_report(tmp: Path, rank: int, tree: Tree, tensors: dict[str, Tensor], rule: Rule, mesh: Mesh) -> dict:
    """Write this rank's shard file into ``tmp`` (if it is first replica of any non-empty
    block) and describe every local tensor for rank 0."""
    specs: dict[str, Spec] = {}
    for path, t in tensors.items():
        specs[path] = rule(path, t.dim())
        try:
            specs[path].validate_axes(mesh)
        except ValueError as e:
            raise LayoutError(f"{path}: {e}") from None
    blocks = [(p, t) for p, t in tensors.items() if t.numel() > 0 and _writes(rule, p, specs[p], mesh, rank)]
    name = file_name(rank) if blocks else None
    result = write_shard(tmp / name, blocks) if name else None
    return {
        "rank": rank,
        "tree": tree,
        "file": None if result is None else {"name": name, "size": result.size, "checksum": result.checksum},
        "tensors": {
            p: {"shape": list(t.shape), "dtype": fmt.dtype_name(t.dtype), "spec": repr(specs[p]),
                "param_shape": rule.param_shape(p, t.dim()),
                "stored": None if result is None or p not in result.stored else vars(result.stored[p])}
            for p, t in tensors.items()
        },
    }


def _writes(rule: Rule, path: str, spec: Spec, mesh: Mesh, rank: int) -> bool:
    """Is ``rank`` the first replica of its block? Under a pipeline, replicas are counted among
    the ranks of the first pipeline index holding the tensor only."""
    pipeline = None if rule.plan is None else rule.plan.pipeline
    if pipeline is None or rule.layout(path) is None:
        return is_writer(spec, mesh, rank)
    holders = pipeline_holders({"pipeline": pipeline_meta(pipeline)}, path)
    if mesh.index(rank, pipeline.axis) != holders[0]:
        return False
    sub, sub_rank = _stage_mesh(mesh, pipeline.axis, rank)
    return is_writer(spec, sub, sub_rank)


def _stage_mesh(mesh: Mesh, axis: str, rank: int) -> tuple[Mesh, int]:
    """The mesh without the pipeline axis, and ``rank``'s place in it."""
    sub = mesh.sub(tuple(a for a in mesh.axis_names if a != axis))
    coords = mesh.coords(rank)
    return sub, sub.rank_of({a: coords[a] for a in sub.axis_names})


def assemble(reports: list[dict], mesh: Mesh, *, strategy: str | None, private: bool, step: int | None,
             plan: dict | None = None, run_id: str | None = None) -> fmt.Manifest:
    """Rank 0's pure step: all ranks' reports -> the manifest (``LayoutError`` if they do not
    describe one consistent state). Under a pipeline (``plan["pipeline"]``) a parameter's
    tensors come from the ranks of its first holding pipeline index, laid out on the mesh
    without the pipeline axis, and the ranks' trees (which list only their own parameters) are
    merged (``merge_trees``)."""
    first = reports[0]
    piped = plan is not None and "pipeline" in plan
    if piped:
        tree = merge_trees([rep["tree"] for rep in reports])
    else:
        tree = first["tree"]
        for r, rep in enumerate(reports):
            if rep["tree"] != first["tree"]:
                raise LayoutError(f"rank {r}'s non-tensor state differs from rank 0's; rank-local values must be"
                                  " tensors")
            if set(rep["tensors"]) != set(first["tensors"]):
                diff = sorted(set(rep["tensors"]) ^ set(first["tensors"]))
                raise LayoutError(f"rank {r} and rank 0 hold different tensors: {diff[:5]}")
    paths = list(dict.fromkeys(p for rep in reports for p in rep["tensors"]))
    tensors = {}
    for path in paths:
        holders = pipeline_holders(plan, path) if piped else None
        on, lay_mesh, ranks = mesh, mesh, list(range(mesh.size))
        if holders is not None:
            axis = plan["pipeline"]["axis"]
            ranks = [r for r in range(mesh.size) if mesh.index(r, axis) == holders[0]]
            lay_mesh = mesh.sub(tuple(a for a in mesh.axis_names if a != axis))
        missing = [r for r in ranks if path not in reports[r]["tensors"]]
        if missing:
            raise LayoutError(f"{path}: ranks {missing[:5]} do not hold it")
        per_rank = [reports[r]["tensors"][path] for r in ranks]
        t0 = per_rank[0]
        for r, t in zip(ranks, per_rank):
            if (t["dtype"], t["spec"]) != (t0["dtype"], t0["spec"]):
                raise LayoutError(f"{path}: rank {r} has {t['dtype']} {t['spec']}, rank {ranks[0]} {t0['dtype']}"
                                  f" {t0['spec']}")
        spec = Spec.parse(t0["spec"])
        shape = global_shape(path, [t["shape"] for t in per_rank], spec, lay_mesh)
        boxes = tuple(
            fmt.BoxRecord(local_box(shape, spec, lay_mesh, i), reports[r]["file"]["name"], **t["stored"])
            for i, (r, t) in enumerate(zip(ranks, per_rank)) if t["stored"] is not None
        )
        del on
        view_of = t0.get("param_shape")
        tensors[path] = fmt.TensorRecord(shape, t0["dtype"], spec, boxes, None if view_of is None else tuple(view_of))
    files = {rep["file"]["name"]: fmt.FileRecord(rep["rank"], rep["file"]["size"], rep["file"]["checksum"])
             for rep in reports if rep["file"] is not None}
    return fmt.Manifest(library_version=library_version(), mesh=mesh, strategy=strategy, files=files,
                        tensors=tensors, state=tree, private=private, step=step,
                        created_unix=time.time(), plan=plan, run_id=run_id)


def merge_trees(trees: list[Tree]) -> Tree:
    """One state tree from pipeline ranks' trees: equal everywhere except that a dict may list
    different tensors on different ranks (each rank holds its own stages' parameters); the
    merged dict has every key, in order of first appearance (rank order). ``LayoutError`` for
    any other difference."""
    first = trees[0]
    if all(t == first for t in trees[1:]):
        return first
    if all(isinstance(t, dict) and set(t) == {"$dict"} for t in trees):
        keys: dict[str, list] = {}
        for t in trees:
            for k, v in t["$dict"]:
                keys.setdefault(k, []).append(v)
        return {"$dict": [[k, merge_trees(vs)] for k, vs in keys.items()]}
    if all(isinstance(t, dict) and set(t) == {"$type", "value"} for t in trees) and \
            len({t["$type"] for t in trees}) == 1:
        return {"$type": first["$type"], "value": merge_trees([t["value"] for t in trees])}
    if all(isinstance(t, dict) and set(t) == {"$tuple"} for t in trees) and len({len(t["$tuple"]) for t in trees}) == 1:
        return {"$tuple": [merge_trees(list(vs)) for vs in zip(*(t["$tuple"] for t in trees))]}
    if all(isinstance(t, list) for t in trees) and len({len(t) for t in trees}) == 1:
        return [merge_trees(list(vs)) for vs in zip(*trees)]
    raise LayoutError(f"the ranks' non-tensor state differs ({str(first)[:60]!r}...); rank-local values must be"
                      " tensors")
