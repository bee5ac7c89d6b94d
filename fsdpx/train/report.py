"""What a run reports: the summary it returns and prints, ``metrics.jsonl`` and ``config.json``
written as JSON (non-finite numbers as ``null``), the progress bar and ``plot.png``. The files
and the terminal live here; the loop (:mod:`fsdpx.train.loop`) only calls these."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

from tqdm import tqdm

from privacy.step import DPConfig

from .config import RunConfig
from .sources import Source

SMOOTHING = 10  # steps averaged for the reported final loss, the progress bar's and the plot's trend line

FILES = ("metrics.jsonl", "plot.png", "config.json", "config.toml")
"""What a run that trains writes into its run directory (``fsdpx.train.loop``'s module doc)."""


def numbers(record: dict[str, Any]) -> dict[str, Any]:
    """A record read back from ``metrics.jsonl`` with its nulls (non-finite values) as NaN."""
    return {**record, **{k: math.nan for k in ("loss", "epsilon") if record.get(k) is None}}


def summary(config: RunConfig, history: list[dict[str, Any]], state: Any, dp: DPConfig | None,
            sample_rate: float, start: float, start_step: int, starts: list[int], stopped: str | None,
            *, sample: str, files: Sequence[str] = FILES, audit: Any = None) -> dict[str, Any]:
    """The summary :func:`fsdpx.train.run` returns (its keys are documented there); ``files``:
    what the segment wrote into ``run_dir`` (none when it had nothing to do); ``audit``: the
    run's :class:`privacy.audit.AuditReport` (``--audit-canaries``), as its fields and its line."""
    rows = [r for r in history if r.get("loss") is not None and math.isfinite(r["loss"])]
    held = last_eval(history)
    return {
        "steps": state.step,
        "start_step": start_step,
        "initial_loss": rows[0]["loss"] if rows else math.nan,
        "initial_step": rows[0]["step"] if rows else None,
        "final_loss": mean([r["loss"] for r in rows[-SMOOTHING:]]),
        "epsilon": state.accountant.epsilon(),
        "delta": config.privacy.delta,
        "noise_multiplier": dp.noise_multiplier if dp else 0.0,
        "sample_rate": sample_rate,
        "seconds": time.perf_counter() - start,
        "run_dir": str(config.run_dir),
        "files": list(files),
        "sample": sample,
        "segment_starts": starts,
        "stopped": stopped,
        "eval_loss": held["eval_loss"] if held else None,
        "eval_ppl": held["eval_ppl"] if held else None,
        "eval_step": held["step"] if held else None,
        "audit": None if audit is None else {**dataclasses.asdict(audit), "line": str(audit)},
    }


def last_eval(history: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest record holding a held-out evaluation (``eval_loss``, finite or not), or None."""
    return next((r for r in reversed(history) if "eval_loss" in r), None)


def eval_text(record: dict[str, Any]) -> str:
    """``eval loss 2.345 (perplexity 10.4) at step 20``: a record's held-out evaluation."""
    loss, ppl = record.get("eval_loss"), record.get("eval_ppl")
    loss = math.nan if loss is None else loss
    ppl = math.inf if ppl is None else ppl
    return f"eval loss {loss:.3f} (perplexity {ppl:.4g}) at step {record['step']}"


def format_summary(summary: dict[str, Any]) -> str:
    """The few lines ``fsdpx train`` prints at the end: the whole run's steps, loss and epsilon
    (a resumed run's first loss is its step 1's, not the segment's), and the files the segment
    wrote ("none written" when it had nothing to do: ``tests/test_train_segments.py::
    test_a_branch_with_nothing_to_do_names_no_files``)."""
    s = summary
    privacy = (f"epsilon {s['epsilon']:.3f} at delta {s['delta']:g} (noise multiplier {s['noise_multiplier']:.3f}, "
               f"sample rate {s['sample_rate']:.4g})" if math.isfinite(s["epsilon"]) else "non-private: no guarantee")
    segment = (f"  (segments start at steps {', '.join(map(str, s['segment_starts']))}; this one trained"
               f" {s['steps'] - s['start_step']} from step {s['start_step']})" if s["segment_starts"] else "")
    first = f"at step {s['initial_step']}" if s["initial_step"] is not None else "(no step recorded)"
    lines = [
        f"steps        {s['steps']}{segment}" + (f"  (stopped early: {s['stopped']})" if s["stopped"] else ""),
        f"loss         {s['initial_loss']:.3f} {first} -> {s['final_loss']:.3f} (mean of the last {SMOOTHING} steps)",
        *([f"held-out     {eval_text({'step': s['eval_step'], **{k: s[k] for k in ('eval_loss', 'eval_ppl')}})}"]
          if s.get("eval_step") is not None else []),
        f"privacy      {privacy}",
        *([f"audit        {s['audit']['line'].removeprefix('audit: ')}"] if s.get("audit") else []),
        f"wall time    {s['seconds']:.1f} s",
        f"sample       {s['sample']!r}",
        f"files        {s['run_dir']}/{{{','.join(s['files'])}}}" if s.get("files", FILES) else
        "files        none written",
    ]
    return "\n".join(lines)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


# --------------------------------------------------------------------------- files


def prepare_run_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def open_log(path: Path, main: bool, *, append: bool = False) -> Iterator[TextIO]:
    """``metrics.jsonl`` opened for writing (appending on resume) on the main rank; a sink
    elsewhere."""
    with open(path if main else os.devnull, "a" if append else "w") as log:
        yield log


def json_safe(x: Any) -> Any:
    """``x`` with every float that is not finite as ``None``: JSON has no inf or nan."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_json(path: Path | None, obj: dict[str, Any]) -> None:
    """``obj`` as indented JSON at ``path``; nothing when ``path`` is None (not the main rank)."""
    if path is None:
        return
    path.write_text(json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n")


def append_jsonl(log: TextIO, record: dict[str, Any]) -> None:
    log.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
    log.flush()


# --------------------------------------------------------------------------- the terminal and the plot


def progress_bar(config: RunConfig, enabled: bool, initial: int = 0) -> tqdm:
    return tqdm(total=config.run.steps, initial=initial, desc=config.logging.name, unit="step",
                disable=not enabled, dynamic_ncols=True)


def bar_text(history: list[dict[str, Any]]) -> str:
    """The progress bar's words after the latest step: the loss as what it is, the mean of the
    last ``SMOOTHING`` steps' batch losses (fewer at the start), epsilon so far
    (``tests/test_cli.py::test_the_progress_bar_says_what_its_loss_is``) and the latest
    held-out evaluation, when the run evaluates (``tests/test_eval.py``)."""
    recent = [r["loss"] for r in history[-SMOOTHING:] if math.isfinite(r["loss"])]
    eps = history[-1]["epsilon"]
    steps = f"last {len(recent)} steps" if len(recent) != 1 else "last step"
    text = f"loss {mean(recent):.3f} (mean of {steps}), epsilon {eps:.2f}" if math.isfinite(eps) else \
        f"loss {mean(recent):.3f} (mean of {steps}), non-private"
    held = last_eval(history)
    return text if held is None else f"{text}, {eval_text(held)}"


def update_bar(bar: tqdm, history: list[dict[str, Any]]) -> None:
    bar.set_postfix_str(bar_text(history), refresh=False)
    bar.update(1)


def plot_title(config: RunConfig, dp: DPConfig | None, source: Source) -> str:
    name = config.logging.name
    model = f"{source.model_name}, block {config.data.block_size}" if source.language_model else source.model_name
    if dp is None:
        return f"{name}: {model}, non-private"
    return f"{name}: {model}, DP-SGD sigma={dp.noise_multiplier:.3f}, q={dp.sample_rate:.4f}, C={dp.clip_norm:g}"


def plot(history: list[dict[str, Any]], path: Path, *, title: str, delta: float, starts: Sequence[int] = (),
         note: str | None = None) -> None:
    """``plot.png``: the loss per step and its trend above, with the held-out loss of the steps
    evaluated (``--eval-data``) as a second curve, epsilon below, a dashed line where each
    resumed or branched segment began, and ``note`` (the audit's line) under the epsilon curve."""
    import matplotlib  # imported here: it is slow to import and the backend must be set first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    trend = [mean([x for x in losses[max(0, i - SMOOTHING + 1): i + 1] if math.isfinite(x)])
             for i in range(len(losses))]
    fig, (ax_loss, ax_eps) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="loss (batch)")
    ax_loss.plot(steps, trend, color="tab:blue", linewidth=2, label=f"loss ({SMOOTHING}-step mean)")
    held = [(r["step"], r["eval_loss"]) for r in history if r.get("eval_loss") is not None]
    if held:
        ax_loss.plot(*zip(*held), color="tab:orange", linewidth=2, marker="o", markersize=4,
                     label="eval loss (held-out)")
    ax_loss.set_ylabel("loss (nats / token)")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)
    epsilons = [r["epsilon"] for r in history]
    for at in starts:  # where a resume or branch began
        for ax in (ax_loss, ax_eps):
            ax.axvline(at + 0.5, color="gray", linestyle="--", linewidth=1)
        ax_loss.text(at + 0.5, 1.0, f" resumed at {at}", transform=ax_loss.get_xaxis_transform(), fontsize=8,
                     color="gray", va="top")
    if epsilons and all(math.isfinite(e) for e in epsilons):
        ax_eps.plot(steps, epsilons, color="tab:red", linewidth=2)
    else:
        ax_eps.text(0.5, 0.5, "non-private: epsilon is infinite", ha="center", va="center", transform=ax_eps.transAxes)
        ax_eps.set_yticks([])
    ax_eps.set_ylabel(f"epsilon (delta={delta:g})")
    ax_eps.set_xlabel("step")
    ax_eps.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if note:  # below the axes, wrapped: the audit's one line is long
        fig.subplots_adjust(bottom=0.2)
        fig.text(0.01, 0.01, textwrap.fill(note, 130), fontsize=7, va="bottom")
    fig.savefig(path, dpi=100)
    plt.close(fig)
