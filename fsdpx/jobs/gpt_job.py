"""Jobs of ``fsdpx train``'s GPT on the embedded corpus: the tasks the built-in techniques run.

``gpt_task("a", steps=200, batch_size=64, n_layer=2, n_embd=64)`` is a :class:`Task` whose
functions are this module's; ``run_config`` turns it into the :class:`fsdpx.train.RunConfig`
that ``fsdpx train`` runs. A private job's noise is calibrated once over the job's full
``steps``, so a run stopped early (a profile, a moved job) and resumed continues with the same
noise multiplier, sample rate and batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fsdpx.models.gpt import GPT, token_loss
from fsdpx.train import RunConfig
from fsdpx.train import data
from fsdpx.train.loop import resolve_privacy, resolve_sample_rate

from .task import Privacy, Task

HPARAMS = ("n_layer", "n_head", "n_embd", "block_size", "corpus_chars", "lr", "seed", "ckpt_every")
"""The ``RunConfig`` fields a GPT job's ``hparams`` may set."""


class UnsupportedTaskError(ValueError):
    """A built-in technique was asked to run a job that is not a ``fsdpx train`` GPT job."""


def _base(hparams: Mapping[str, Any]) -> RunConfig:
    unknown = sorted(set(hparams) - set(HPARAMS))
    if unknown:
        raise UnsupportedTaskError(f"hparams {unknown} are not RunConfig fields of a GPT job; allowed: {HPARAMS}")
    return RunConfig(private=False, **hparams)


def gpt_model(hparams: Mapping[str, Any]) -> GPT:
    """The GPT of ``RunConfig(**hparams)`` (randomly initialised; the run seeds its own)."""
    return GPT(_base(hparams).model_config())


def corpus_data(hparams: Mapping[str, Any]):
    """``(inputs, targets)`` of the embedded corpus at the job's ``corpus_chars`` and ``block_size``."""
    c = _base(hparams)
    return data.make_examples(data.corpus(c.corpus_chars), c.block_size)


def gpt_task(name: str, *, steps: int, batch_size: float, privacy: Privacy | None = None, **hparams: Any) -> Task:
    """A :class:`Task` training the GPT of ``hparams`` (keys of ``HPARAMS``) on the corpus."""
    _base(hparams)
    return Task(name, gpt_model, corpus_data, token_loss, steps=steps, batch_size=batch_size, privacy=privacy,
                hparams=hparams)


def is_gpt_task(task: Task) -> bool:
    """Whether ``task`` was built by :func:`gpt_task` (the functions are this module's)."""
    return task.model_fn is gpt_model and task.data_fn is corpus_data and task.loss_fn is token_loss


def run_config(task: Task, *, strategy: str, steps: int, out: Path, ckpt_dir: Path, offload: str = "none",
               offload_topk: float = 0.1) -> RunConfig:
    """The ``RunConfig`` training ``task`` under ``strategy`` up to step ``steps`` (resuming
    from ``ckpt_dir`` when it holds a checkpoint), writing its run directory to ``out/run``.

    A private job gets the noise multiplier calibrated for ``task.steps`` (not ``steps``).
    Raises :class:`UnsupportedTaskError` for a job not built by :func:`gpt_task`, and
    ``ValueError`` when ``steps`` exceeds ``task.steps``."""
    if not is_gpt_task(task):
        raise UnsupportedTaskError(f"job {task.name!r} is not a GPT job of fsdpx train; the built-in techniques run"
                                   " only those (register a technique for other models)")
    if not 1 <= steps <= task.steps:
        raise ValueError(f"job {task.name!r}: steps must be in [1, {task.steps}], got {steps}")
    common = dict(task.hparams, name="run", out=str(out), batch_size=float(task.batch_size), strategy=strategy,
                  offload=offload, offload_topk=offload_topk, ckpt_dir=str(ckpt_dir), resume=True)
    p = task.privacy
    if p is None:
        return RunConfig(**common, steps=steps, private=False)
    full = RunConfig(**common, steps=task.steps, private=True, target_epsilon=p.target_epsilon,
                     noise_multiplier=p.noise_multiplier, delta=p.delta, clip_norm=p.clip_norm)
    inputs, _ = corpus_data(task.hparams)
    sigma = resolve_privacy(full, resolve_sample_rate(full, int(inputs.shape[0]))).noise_multiplier
    return RunConfig(**common, steps=steps, private=True, noise_multiplier=sigma, delta=p.delta, clip_norm=p.clip_norm)
