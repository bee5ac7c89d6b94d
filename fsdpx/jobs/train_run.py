"""A job as an ``fsdpx train`` run: the :class:`fsdpx.train.RunConfig` a built-in technique
executes (``execute.launch`` writes it, ``worker.py`` runs it on every rank).

A GPT job (``gpt_job.gpt_task``) becomes ``fsdpx train``'s own GPT on the corpus; any other job
becomes ``model = "python"``: its three functions by reference (``"module:qualname"``,
:mod:`fsdpx.train.refs`), imported by every torchrun worker, and its ``hparams`` passed to them.
Either way the run is ``fsdpx train``'s loop: Poisson batches of expected size ``batch_size``
(the same draws with or without privacy), the sharded step of the technique's strategy, AdamW,
checkpoints every ``ckpt_every`` steps and ``metrics.jsonl``.

A private job's noise is calibrated once over the job's full ``steps``, so a run stopped early
(a profile, a moved job) and resumed continues with the same noise multiplier, sample rate and
batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdpx.train import RunConfig
from fsdpx.train.build import resolve_privacy, resolve_sample_rate
from fsdpx.train.refs import NotImportableError, function_ref

from .gpt_job import corpus_data, is_gpt_task
from .task import Task, UnimportableTaskError

RUN_HPARAMS = ("lr", "seed", "ckpt_every")
"""Keys of a job's ``hparams`` that also set its run (learning rate, the seed of its model,
data, batches and noise, its checkpoint cadence), as for GPT jobs; the functions see them too."""

FUNCTIONS = ("model_fn", "data_fn", "loss_fn")


def function_refs(task: Task) -> dict[str, str]:
    """``{"model_fn": "module:qualname", ...}`` of a job that is not a GPT job, checked now.

    Raises :class:`UnimportableTaskError` naming the job, the function and how to fix it, when
    a function cannot be imported by name (``fsdpx.train.refs.function_ref``: a lambda, a local
    function, one of ``__main__``), or when ``hparams`` are not JSON values (they travel to the
    workers in a file) (``tests/test_jobs_user_task.py::test_a_lambda_is_refused_by_name_before_anything_starts``)."""
    out = {}
    for key in FUNCTIONS:
        try:
            out[key] = function_ref(getattr(task, key))
        except NotImportableError as e:
            raise UnimportableTaskError(f"job {task.name!r}: {key} {e}") from None
    try:
        json.dumps(task.hparams, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnimportableTaskError(f"job {task.name!r}: hparams must be JSON values (numbers, strings, lists,"
                                    f" tables), as the workers read them from a file: {e}") from None
    return out


def check_runnable(task: Task) -> None:
    """Raise what :func:`function_refs` raises when the built-ins cannot run ``task``; nothing
    for a GPT job."""
    if not is_gpt_task(task):
        function_refs(task)


def source_fields(task: Task) -> dict[str, Any]:
    """The ``RunConfig`` fields saying what ``task`` trains (model, data, loss, and the
    ``RUN_HPARAMS`` it sets)."""
    if is_gpt_task(task):
        return dict(task.hparams)
    return {"model": "python", **function_refs(task), "hparams": dict(task.hparams),
            **{k: task.hparams[k] for k in RUN_HPARAMS if k in task.hparams}}


def num_examples(task: Task) -> int:
    """The size of the job's dataset (``data_fn`` called once)."""
    inputs, _ = (corpus_data if is_gpt_task(task) else task.data_fn)(task.hparams)
    return int(inputs.shape[0])


def run_config(task: Task, *, strategy: str | None, steps: int, out: Path, ckpt_dir: Path, offload: str = "none",
               offload_topk: float = 0.1, **parallel: Any) -> RunConfig:
    """The ``RunConfig`` training ``task`` under ``strategy`` (None: one process, no sharding)
    up to step ``steps`` (``resume_if_present``: resuming from ``ckpt_dir`` when it holds a
    checkpoint, starting otherwise), writing its run directory to ``out/run``; ``parallel``: ``tp``, ``pp``, ``schedule``, ``microbatches``.

    A private job gets the noise multiplier calibrated for ``task.steps`` (not ``steps``), so
    every segment of it, on any technique, draws the same noise. Raises
    :class:`UnimportableTaskError` (:func:`function_refs`) and ``ValueError`` when ``steps`` is
    not in ``[1, task.steps]``."""
    if not 1 <= steps <= task.steps:
        raise ValueError(f"job {task.name!r}: steps must be in [1, {task.steps}], got {steps}")
    common = dict(source_fields(task), name="run", out=str(out), batch_size=float(task.batch_size),
                  strategy=strategy, offload=offload, offload_topk=offload_topk, ckpt_dir=str(ckpt_dir),
                  resume_if_present=True,
                  **parallel)
    p = task.privacy
    if p is None:
        return RunConfig.of(**common, steps=steps, private=False)
    full = RunConfig.of(**common, steps=task.steps, private=True, target_epsilon=p.target_epsilon,
                        noise_multiplier=p.noise_multiplier, delta=p.delta, clip_norm=p.clip_norm)
    sigma = resolve_privacy(full, resolve_sample_rate(full, num_examples(task))).noise_multiplier
    return RunConfig.of(**common, steps=steps, private=True, noise_multiplier=sigma, delta=p.delta,
                        clip_norm=p.clip_norm)
