"""Held-out evaluation (``--eval-data PATH --eval-every N [--eval-batches K]``): the model's mean
token loss and perplexity on a file the run does not train on, in ``metrics.jsonl``, the progress
bar, the summary and ``plot.png`` (:class:`fsdpx.train.config.EvalSettings`).

    held = build_eval_set(config, source, batch_size=32)   # the fixed examples, read once
    loss = eval_loss(source, params, held, comm=comm)       # every rank calls it; the same float on all
    record.update(eval_metrics(loss))                       # {"eval_loss": ..., "eval_ppl": ...}

Privacy: evaluation is a forward pass only, with no gradient, no clipping, no noise and no
accountant call, on parameters the run has already released to its accountant: it spends no
privacy budget with respect to the training examples (``epsilon`` is the same with and without
it: ``tests/test_eval.py::test_evaluation_spends_no_budget_and_changes_no_step``). Its numbers are
computed from the eval examples themselves, which the guarantee does not cover, so these must be
disjoint from the training data; the training file given again as ``--eval-data`` is named in a
warning (:func:`same_file_warning`).

Examples: ``eval_data`` is read as the training data is (:func:`fsdpx.train.sources.build_tokens`:
its kind, tokenizer and ``block_size``; a ``.npy``/``.bin`` file memory-mapped, only the rows
evaluated read), cut into non-overlapping windows (:func:`fsdpx.train.data.windows`); a run on
the embedded corpus reads a text file with the corpus's character alphabet. Of its ``N``
windows, ``n = min(eval_batches * eval_batch_size, N)`` evenly spaced ones (rows ``i * N // n``)
are evaluated, the same at every evaluation and in every layout.

Layouts: every rank gathers the whole parameters (:func:`fsdpx.train.loop.full_params`, as the
end-of-run sample and export do), evaluates its share of the batches (batch ``b`` on rank
``b % world``) with the plain model, and the ranks' sums are gathered and added in rank order, so
every rank holds the same number; it equals the one-process evaluation of the same parameters up
to float summation order (relative 1e-6, ``tests/test_eval.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fsdpx.sharding.comm import Comm

from . import data
from .config import RunConfig
from .errors import ConfigError
from .sources import Source, Tokens, VocabularyError, build_tokens, data_kind, input_embedding


class EvalDataError(ConfigError):
    """``eval_data`` cannot be evaluated: missing, unreadable, too short for one example, or
    holding token ids the model does not have."""


class EvalSet(NamedTuple):
    """The fixed examples of an evaluation: ``inputs``/``targets`` ``(n, block_size)`` int64 on
    the host, evaluated ``batch_size`` at a time; ``total``: the file's windows (``N``);
    ``description``: what was read."""

    inputs: Tensor
    targets: Tensor
    batch_size: int
    total: int
    description: str


def eval_batch_size(config: RunConfig, num_examples: int) -> int:
    """``eval_batch_size``, or the training's expected batch size (``batch_size``, or
    ``sample_rate * num_examples``) rounded, at least 1."""
    given = config.eval.eval_batch_size
    if given is not None:
        return given
    p = config.privacy
    expected = p.batch_size if p.batch_size is not None else p.sample_rate * num_examples
    return max(1, round(expected))


def build_eval_set(config: RunConfig, source: Source, *, batch_size: int) -> EvalSet | None:
    """The examples ``config.eval`` evaluates (module doc), or None when evaluation is off.

    Guarantees: a pure function of ``config`` and the file: the same rows on every rank and
    every call; every id below the model's vocabulary. Raises :class:`EvalDataError` naming
    ``eval_data`` for a path that does not exist or cannot be read as the training data's kind,
    a file too short for one example of ``block_size``, or token ids the model does not have
    (``tests/test_eval.py::test_bad_eval_data_is_refused_before_anything_is_written``)."""
    if not config.eval.enabled:
        return None
    tokens = eval_tokens(config)
    block = config.data.block_size
    cut = data.windows if isinstance(tokens.ids, Tensor) else data.mapped_windows
    windows_in, windows_out = cut(tokens.ids, block)
    total = int(windows_in.shape[0])
    if total < 1:
        raise EvalDataError(f"eval_data {config.eval.eval_data}: {len(tokens.ids)} tokens give no example of"
                            f" block_size {block} (each needs block_size + 1 tokens)")
    n = min(config.eval.eval_batches * batch_size, total)
    rows = torch.arange(n, dtype=torch.int64) * total // n  # (n,): evenly spaced, row 0 first
    inputs, targets = windows_in[rows], windows_out[rows]  # (n, block) each: a mapped file reads these rows only
    check_ids(source, torch.cat([inputs, targets[:, -1:]], 1), config.eval.eval_data)
    return EvalSet(inputs, targets, batch_size, total, tokens.description)


def eval_tokens(config: RunConfig) -> Tokens:
    """The token stream of ``eval_data``, read as the training data is: the same ``data`` kind
    (``auto`` reads it off the eval path; a run on the embedded corpus: ``auto``), tokenizer,
    dtype, column and split. A text file of a run on the embedded corpus without a tokenizer is
    encoded with the corpus's character alphabet (:func:`fsdpx.train.data.encode`)."""
    path = Path(config.eval.eval_data)
    if not path.exists():
        raise EvalDataError(f"eval_data {path} does not exist")
    kind = "auto" if data_kind(config) == "corpus" else config.data.kind
    like = config.replace(data=kind, data_path=str(path))
    if data_kind(config) == "corpus" and config.data.tokenizer is None and data_kind(like) == "text":
        return _alphabet_tokens(path)
    try:
        return build_tokens(like)
    except ConfigError as err:  # the training reader's words name data_path: here it is eval_data's
        raise EvalDataError(str(err).replace("data_path", "eval_data")) from None


def _alphabet_tokens(path: Path) -> Tokens:
    """A text file under the embedded corpus's character tokenizer."""
    try:
        ids = data.encode(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise EvalDataError(f"eval_data {path} is not a UTF-8 text file: {err}") from None
    except ValueError as err:
        raise EvalDataError(f"eval_data {path}: {err} (a run on the embedded corpus reads its characters only;"
                            " give --tokenizer bytes to train and evaluate on bytes)") from None
    return Tokens(ids, data.VOCAB_SIZE, data.encode, data.decode, f"text {path}, the corpus's characters")


def check_ids(source: Source, ids: Tensor, where: str) -> None:
    """Raise :class:`EvalDataError` (a negative id) or :class:`VocabularyError` (an id the
    model's token embedding does not have) for the ids evaluated, naming ``eval_data``."""
    if ids.numel() and int(ids.min()) < 0:
        raise EvalDataError(f"eval_data {where}: token ids must be >= 0, found {int(ids.min())}")
    emb = input_embedding(source.model)
    top = int(ids.max()) if ids.numel() else -1
    if emb is not None and top >= emb.num_embeddings:
        raise VocabularyError(f"eval_data {where} holds token id {top}, but the model's vocabulary has"
                              f" {emb.num_embeddings} ids (0..{emb.num_embeddings - 1})")


def eval_loss(source: Source, params: dict[str, Tensor], held: EvalSet, *, comm: Comm | None) -> float:
    """The mean token loss of the model with ``params`` (whole, as :func:`fsdpx.train.loop.full_params`
    returns them; called on every rank of a sharded run) on ``held``'s examples.

    Guarantees: forward only, under ``torch.no_grad`` with every module in eval mode (dropout
    off; each module's own mode restored after), no random number drawn: the run's steps are
    the same with and without evaluation. Every rank returns the same float (the ranks' float64
    sums gathered and added in rank order). All examples have ``block_size`` tokens, so the mean
    of the per-example losses is the mean token loss. Non-finite losses are returned as they are."""
    rank, world = (comm.rank, comm.mesh.size) if comm is not None else (0, 1)
    device = _model_device(source, params)
    params = {k: v.to(device) for k, v in params.items()}
    starts = range(0, held.inputs.shape[0], held.batch_size)
    total = 0.0
    with _evaluating(source.model):
        for b, lo in enumerate(starts):
            if b % world != rank:
                continue
            x = held.inputs[lo: lo + held.batch_size].to(device)  # (B, T)
            y = held.targets[lo: lo + held.batch_size].to(device)  # (B, T)
            out = functional_call(source.model, params, (x,))
            total += float(source.loss_fn(out, y).double().sum())
    sums = comm.all_gather_object(total) if comm is not None else [total]
    return math.fsum(sums) / held.inputs.shape[0]


def eval_metrics(loss: float, seconds: float) -> dict[str, float]:
    """The keys an evaluated step's ``metrics.jsonl`` line gets: ``eval_loss`` (nats per token),
    ``eval_ppl`` (``exp(eval_loss)``; inf past float range) and ``eval_seconds`` (wall seconds
    the evaluation took, part of the step's ``step_seconds``)."""
    ppl = math.exp(loss) if loss < 709 else math.inf  # exp overflows a float past ~709.78
    return {"eval_loss": loss, "eval_ppl": ppl, "eval_seconds": seconds}


def same_file_warning(config: RunConfig) -> str | None:
    """The warning for an ``eval_data`` that is the training file itself (``data_path``; the same
    file by ``os.path.samefile``, else by resolved path), naming both flags; None otherwise (no
    evaluation, or training on the embedded corpus or ``data_fn``). Its loss is no held-out
    measure and is computed from the training examples outside the privacy guarantee."""
    if not config.eval.enabled or config.data.data_path is None:
        return None
    train, held = Path(config.data.data_path), Path(config.eval.eval_data)
    try:
        same = os.path.samefile(train, held)
    except OSError:
        same = train.resolve() == held.resolve()
    if not same:
        return None
    return (f"--eval-data {held} is the training file (--data-path {train}): its eval loss is measured on the"
            " examples the model trains on, not held-out ones, and is computed from them outside the privacy"
            " guarantee")


def _model_device(source: Source, params: dict[str, Tensor]) -> torch.device:
    """Where the model's forward runs: its buffers' or real parameters' device (parameters may be
    on ``meta``: a rank that read only its blocks), else the parameters'."""
    real = [t for t in [*source.model.parameters(), *source.model.buffers()] if not t.is_meta]
    return real[0].device if real else next(iter(params.values())).device


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Inside: every module of ``model`` in eval mode and no gradients; after: each module's own
    mode back (a part the user keeps in eval stays in eval)."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, training in modes.items():
            module.training = training
