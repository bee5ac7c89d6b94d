"""Jobs of ``fsdpx train``'s GPT on the embedded corpus (what ``jobs.toml`` describes).

``gpt_task("a", steps=200, batch_size=64, n_layer=2, n_embd=64)`` is a :class:`Task` whose
functions are this module's; ``fsdpx.jobs.train_run.run_config`` turns it into the
:class:`fsdpx.train.RunConfig` of ``fsdpx train``'s own GPT and corpus (any other task runs as
``model = "python"``).
"""

from __future__ import annotations

from typing import Any, Mapping

from fsdpx.models.gpt import GPT, token_loss
from fsdpx.train import RunConfig
from fsdpx.train import data

from .task import Privacy, Task, UnsupportedTaskError

HPARAMS = ("n_layer", "n_head", "n_embd", "block_size", "corpus_chars", "lr", "seed", "ckpt_every")
"""The ``RunConfig`` fields a GPT job's ``hparams`` may set."""


def _base(hparams: Mapping[str, Any]) -> RunConfig:
    unknown = sorted(set(hparams) - set(HPARAMS))
    if unknown:
        raise UnsupportedTaskError(f"hparams {unknown} are not RunConfig fields of a GPT job; allowed: {HPARAMS}")
    return RunConfig.of(private=False, **hparams)


def gpt_model(hparams: Mapping[str, Any]) -> GPT:
    """The GPT of ``RunConfig.of(**hparams)`` (randomly initialised; the run seeds its own)."""
    return GPT(_base(hparams).model_config())


def corpus_data(hparams: Mapping[str, Any]):
    """``(inputs, targets)`` of the embedded corpus at the job's ``corpus_chars`` and ``block_size``."""
    c = _base(hparams)
    return data.make_examples(data.corpus(c.data.corpus_chars), c.data.block_size)


def gpt_task(name: str, *, steps: int, batch_size: float, privacy: Privacy | None = None, **hparams: Any) -> Task:
    """A :class:`Task` training the GPT of ``hparams`` (keys of ``HPARAMS``) on the corpus."""
    _base(hparams)
    return Task(name, gpt_model, corpus_data, token_loss, steps=steps, batch_size=batch_size, privacy=privacy,
                hparams=hparams)


def is_gpt_task(task: Task) -> bool:
    """Whether ``task`` was built by :func:`gpt_task` (the functions are this module's)."""
    return task.model_fn is gpt_model and task.data_fn is corpus_data and task.loss_fn is token_loss
