"""A run as a sequence of segments: what a resume or a branch may change, and its record.

A segment is one invocation of the training loop: the first run, each ``--resume`` and each
``--resume-from`` branch. Every checkpoint root holds ``run.json``, the lineage of the run
writing into it::

    {"run_dir": "runs/a", "segments": [{"start_step": 0, "source_checkpoint": null,
      "config": {...RunConfig...}, "derived": {...}, "fingerprint": {...}, ...}, ...]}

so any intact checkpoint says which configuration produced it (the last segment that started
before its step) and what its data and model were. The same list is written to the run
directory's ``config.json`` under ``"segments"``.

What may change when a segment starts (``ALLOWED_CHANGES``): optimizer hyper-parameters, clip
norm and clipping, batch size / sample rate, noise and target (a larger budget only with
``allow_budget_increase``, see :mod:`fsdpx.train.budget`), steps, checkpoint cadence and
directory, and the sharding strategy and process count (the checkpoint reshards). What may not,
each a named error before anything runs (:func:`check_compatible`): the model's shape
(:class:`ModelChangeError`), the optimizer (:class:`OptimizerChangeError`: AdamW, SGD, SGD with
momentum; a nonzero momentum's value may change), the LoRA adapters (:class:`LoraChangeError`), the data
(:class:`DataChangeError`, unless ``allow_new_data``) and private <-> non-private
(:class:`PrivacyModeChangeError`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from torch import Tensor

from .data import Windows
from .lora import lora_text

RECORD = "run.json"

ALLOWED_CHANGES = ("lr", "momentum", "clip_norm", "clipping", "method", "batch_size", "sample_rate", "noise_multiplier",
                   "target_epsilon", "epsilon_budget", "max_noise_multiplier", "delta", "accountant",
                   "accounting_interval", "steps", "seed", "ckpt_every", "ckpt_dir", "strategy", "tp",
                   "sequence_parallel", "pp", "schedule", "microbatches", "virtual_stages", "name", "out", "freeze",
                   "precision")
"""``RunConfig`` fields a resumed or branched segment may set to new values (``delta`` and a
larger budget only with ``allow_budget_increase``). ``seed`` re-seeds the Poisson sampler of
the remaining steps; the noise key travels in the checkpoint."""


class ResumeError(ValueError):
    """A segment asked for a change that a resume cannot honour; the message says which."""


class ModelChangeError(ResumeError):
    """The configured model's parameters do not have the checkpoint's shapes."""


class OptimizerChangeError(ResumeError):
    """The run's optimizer (``--optimizer``, ``--momentum`` zero or not) differs from the one
    whose state the checkpoint holds."""


class LoraChangeError(ResumeError):
    """The run's LoRA adapters (``--lora``) differ from those the checkpoint trained."""


class DataChangeError(ResumeError):
    """The examples differ from those the checkpoint was trained on (``allow_new_data`` to accept)."""


class PrivacyModeChangeError(ResumeError):
    """A private run resumed as non-private, or the reverse."""


class BranchError(ResumeError):
    """A branch would write where its source lives (its run directory or checkpoint root)."""


class CheckpointNotFoundError(ResumeError):
    """``resume_from`` names no intact checkpoint."""


# --------------------------------------------------------------------------- fingerprints (pure)


class DataDigest(str):
    """The digest of examples cut on demand from a mapped token file (``"v2:"`` and the SHA-256
    of its tokens as stored, :meth:`fsdpx.train.data.Windows.digest`), with ``legacy()``: the
    digest the same examples had as int64 tensors, computed only when a checkpoint written before
    files were mapped is resumed (:func:`fsdpx.train.resume.plan_segment`)."""

    legacy: Any

    def __new__(cls, value: str, legacy: Any) -> "DataDigest":
        digest = super().__new__(cls, value)
        digest.legacy = legacy
        return digest


PENDING_DIGEST = "pending"
"""A fresh segment's fingerprint's ``data`` while its mapped file is still being hashed
(:func:`fsdpx.train.resume.plan_segment`); replaced before the run's first checkpoint."""


def later_digest(inputs: Any, targets: Any) -> str | Callable[[], str]:
    """:func:`data_digest` of the examples, or, for examples cut from a mapped file whose hash
    is still running in the background, a function that waits for it: the first step does not."""
    if isinstance(inputs, Windows) and not inputs.digest_ready():
        return lambda: data_digest(inputs, targets)
    return data_digest(inputs, targets)


def data_digest(inputs: Any, targets: Any) -> str:
    """SHA-256 of the examples' bytes: equal iff the run trains on the same token sequences.
    Examples cut on demand (:class:`fsdpx.train.data.Windows`) give a :class:`DataDigest`: one
    read of the file's tokens, not a hash of every example's int64 bytes."""
    if isinstance(inputs, Windows):
        return DataDigest(inputs.digest(), lambda: inputs.legacy_digest(targets))
    h = hashlib.sha256()
    for t in (inputs, targets):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def fingerprint(config: Any, params: Mapping[str, Tensor], digest: str, *, data: str | None = None) -> dict[str, Any]:
    """What a resume must keep: parameter shapes, the data's digest, private or not, the LoRA
    adapters (the offload and ``data``, the data's description, are recorded, not checked)."""
    return {"params": {k: list(v.shape) for k, v in params.items()}, "data": digest,
            "corpus_chars": config.data.corpus_chars, "data_source": data, "private": config.privacy.private,
            "offload": config.offload.kind, "lora": config.model.lora, "optimizer": config.run.optimizer,
            "momentum": config.run.momentum}


def check_compatible(recorded: Mapping[str, Any] | None, new: Mapping[str, Any], *,
                     checkpoint_shapes: Mapping[str, Sequence[int]], checkpoint_private: bool,
                     allow_new_data: bool) -> list[str]:
    """Raise the named :class:`ResumeError` for a change a resume cannot honour.

    ``recorded`` is the fingerprint of the segment that wrote the checkpoint (``None`` when the
    root has no ``run.json``); ``checkpoint_shapes`` and ``checkpoint_private`` come from the
    checkpoint's own manifest, so the model and the privacy mode are checked even without a
    record. Returns notes for the user (the data could not be checked; new data was accepted).

    Guarantee: one test per error in ``tests/test_train_segments.py``
    (``test_changes_a_resume_cannot_honour_are_named_errors_before_anything_runs``)."""
    if checkpoint_private != new["private"]:
        was, now = ("private", "non-private") if checkpoint_private else ("non-private", "private")
        raise PrivacyModeChangeError(f"the checkpoint is of a {was} run; it cannot be resumed as a {now} run"
                                     " (its accountant and guarantee would not hold)")
    if recorded is not None and recorded.get("lora") != new.get("lora"):
        raise LoraChangeError(f"the checkpoint was trained with --lora {_lora_words(recorded.get('lora'))}, this run"
                              f" asks for --lora {_lora_words(new.get('lora'))}: the adapters cannot change on resume"
                              " (give the checkpoint's --lora, or none: a resume keeps it)")
    check_optimizer(recorded, new, checkpoint_shapes)
    for name, shape in new["params"].items():
        got = checkpoint_shapes.get(f"params/{name}")
        if got is None or list(got) != list(shape):
            raise ModelChangeError(f"checkpoint tensor params/{name} has shape {None if got is None else tuple(got)},"
                                   f" the configured model needs {tuple(shape)}: the model's shape cannot change on"
                                   " resume")
    notes = []
    if recorded is None:
        return ["the checkpoint root has no run.json: the data was not checked"]
    if recorded["data"] != new["data"]:
        if not allow_new_data:
            was, now = recorded.get("data_source"), new.get("data_source")
            change = (f"{was} -> {now}" if was and now and was != now else
                      f"corpus_chars {recorded['corpus_chars']} -> {new['corpus_chars']}")
            raise DataChangeError(f"the examples differ from those the checkpoint was trained on ({change});"
                                  " pass --allow-new-data to train on other data (the accountant's history still"
                                  " counts)")
        notes.append("training on new data (allowed by --allow-new-data)")
    return notes


def check_optimizer(recorded: Mapping[str, Any] | None, new: Mapping[str, Any],
                    checkpoint_shapes: Mapping[str, Sequence[int]]) -> None:
    """Raise :class:`OptimizerChangeError` naming the flags when the run's optimizer is not the one
    whose state the checkpoint holds: by its segment's record (records from before the setting:
    AdamW), else by the checkpoint's own state tensors (AdamW's ``nu``, SGD's ``momentum``, or
    no slot: SGD without momentum)
    (``tests/test_train_optimizer.py::test_a_resume_keeps_the_optimizer_and_refuses_another``)."""
    kind, momentum = new.get("optimizer", "adamw"), new.get("momentum", 0.0)
    if recorded is not None:
        was_kind, was_momentum = recorded.get("optimizer", "adamw"), recorded.get("momentum", 0.0)
        was = _optimizer_words(was_kind, was_momentum)
    else:  # the state tensors say which slots it kept, not a momentum's value
        slots = {part for key in checkpoint_shapes if key.startswith("opt_state/") for part in key.split("/")[1:]}
        was_kind, was_momentum = ("adamw", 0.0) if "nu" in slots else ("sgd", float("momentum" in slots))
        was = "sgd --momentum (nonzero)" if was_momentum else was_kind
    if (was_kind, bool(was_momentum)) != (kind, bool(momentum)):
        raise OptimizerChangeError(f"--optimizer {_optimizer_words(kind, momentum)}: the checkpoint's steps used"
                                   f" --optimizer {was}; the optimizer cannot change on resume (its state is in the"
                                   " checkpoint)")


def _optimizer_words(kind: str, momentum: float) -> str:
    return f"{kind} --momentum {momentum:g}" if kind == "sgd" and momentum else kind


def _lora_words(lora: Mapping[str, Any] | None) -> str:
    return f"'{lora_text(lora)}'" if lora else "(none: the whole model)"


# --------------------------------------------------------------------------- the record


def owner(segments: Sequence[Mapping[str, Any]], step: int) -> Mapping[str, Any] | None:
    """The segment that wrote the checkpoint of ``step``: the last one started before it."""
    before = [s for s in segments if s["start_step"] < step]
    return before[-1] if before else None


def lineage(segments: Sequence[Mapping[str, Any]], step: int) -> list[dict[str, Any]]:
    """The segments that led to the state of ``step``: those started before it (a segment
    started at or after ``step`` was abandoned by this resume)."""
    return [dict(s) for s in segments if s["start_step"] < step]


def read_record(root: str | Path) -> dict[str, Any] | None:
    """The ``run.json`` of a checkpoint root, or ``None`` when it has none."""
    path = Path(root) / RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def write_record(root: str | Path, record: Mapping[str, Any]) -> None:
    """Write ``run.json`` atomically (a temporary file renamed over it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{RECORD}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, root / RECORD)


# --------------------------------------------------------------------------- metrics


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (empty when there is none); a torn last line (a run
    killed while writing it) is dropped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def cut_back(rows: Sequence[Mapping[str, Any]], step: int) -> list[dict[str, Any]]:
    """The records of steps ``1..step``, in order, one per step: a segment resumed at ``step``
    rewrites everything after it, so no step appears twice
    (``tests/test_train_segments.py::test_a_resume_cuts_the_metrics_back_to_its_checkpoint``)."""
    seen, out = set(), []
    for r in rows:
        if r["step"] <= step and r["step"] not in seen:
            seen.add(r["step"])
            out.append(dict(r))
    return sorted(out, key=lambda r: r["step"])


def write_metrics(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Replace ``metrics.jsonl`` with ``rows`` atomically (JSON lines)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
    os.replace(tmp, path)
