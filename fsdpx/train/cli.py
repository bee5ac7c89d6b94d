"""``fsdpx train``: the command line of the training job (the ``fsdpx`` front door,
:mod:`fsdpx.cli`, dispatches ``train`` here).

    fsdpx train                          # ~2 min private run on the embedded corpus -> runs/private/
    fsdpx train --non-private            # the same loop without clipping or noise -> runs/non-private/
    fsdpx train --noise-multiplier 1.0 --batch-size 256 --steps 100 --name sigma1
    fsdpx train --config run.toml --steps 50   # a config file (fsdpx.train.config); flags override it

Flags map one to one onto the flat names of :class:`fsdpx.train.RunConfig`'s settings
(``--n-embd`` -> ``n_embd``, in ``config.model``) and onto the keys of a ``--config`` file, so a
new option is one ``add_argument`` here, one field in its section's value
(``fsdpx.train.config``) and, if it changes how a step is computed, one branch in
:func:`fsdpx.train.build_step`. Bad values, in a flag or in the file, exit with status 2 and a
one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tomllib
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NoReturn

# Only light modules here: the parser and its defaults come before torch, the privacy core and
# the runtime, which main() imports once the arguments parse (``--help`` and a bad flag answer in
# well under a second: ``tests/test_fast_feedback.py``).
from .config import (DATA_KINDS, DEVICES, FIELDS, MODEL_KINDS, OPTIMIZERS, PRECISIONS, SELECT_STRATEGIES, TOKEN_DTYPES,
                     RunConfig, merge, read_file)
from .deepspeed import read_deepspeed
from .errors import ConfigError
from .flags import FlagParser
from .layout import SCHEDULES, STRATEGIES

_DEFAULTS = SimpleNamespace(**RunConfig().flat())  # the flags' defaults, by flat name


# --------------------------------------------------------------------------- value checks


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _open_unit(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def _half_open_unit(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _unit_interval(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _interval(text: str) -> int | str:
    """``--offload-interval``, ``--offload-select-interval``: an integer >= 1 or "auto"."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or auto, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or auto, got {text}")
    return value


# argparse names the type function in its message when it raises ValueError ("invalid
# _positive_int value"); these names read better.
_positive_int.__name__ = _non_negative_int.__name__ = "integer"
for _f in (_positive_float, _non_negative_float, _open_unit, _half_open_unit, _unit_interval):
    _f.__name__ = "number"
_interval.__name__ = "interval"
_VALUE_CHECKS = (_positive_int, _non_negative_int, _positive_float, _non_negative_float, _open_unit, _half_open_unit,
                 _unit_interval, _interval)


def _table(text: str) -> dict[str, Any]:
    """``--model-fields``: a JSON object or TOML inline-table keys (``n_embd = 32, n_layer = 2``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        try:
            value = tomllib.loads(f"t = {{{text.strip().strip('{}')}}}")["t"]
        except tomllib.TOMLDecodeError:
            value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a table such as 'n_embd = 32, n_layer = 2', got {text!r}")
    return value


_table.__name__ = "table"


# --------------------------------------------------------------------------- parser


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=_positive_int, metavar="N", default=d.steps,
                     help="training steps (default %(default)s)")
    run.add_argument("--name", metavar="NAME", default=None,
                     help="run name; files go to DIR/NAME (default: private or non-private)")
    run.add_argument("--out", metavar="DIR", default=d.out, help="directory holding the runs (default %(default)s)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the files of an existing run directory DIR/NAME (refused without it, unless the"
                          " run continues into it with --resume)")
    run.add_argument("--export", action=argparse.BooleanOptionalAction, default=d.export,
                     help="at the end, write the trained model to DIR/NAME/model, a directory transformers'"
                          " from_pretrained loads (the built-in GPT: fsdpx.train.export.load_gpt); default on;"
                          " later, from any checkpoint: fsdpx export CKPT --to OUT")
    run.add_argument("--seed", type=int, metavar="N", default=d.seed,
                     help="seed of init, sampling and noise (default %(default)s)")
    run.add_argument("--corpus-chars", type=_positive_int, metavar="N", default=d.corpus_chars,
                     help="length of the embedded corpus (default %(default)s)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--verbose", action="store_true",
                     help="a sharded run shows every rank's own errors and tracebacks and torchrun's log lines and"
                          " failure banners (also FSDPX_VERBOSE=1); without it a failure is one line, once: the first"
                          " failing rank's. Exit status: 2 refused, 1 failed while running, 130 SIGINT, 143 SIGTERM"
                          " (the step under way finishes; with --ckpt-dir a checkpoint of it is written within"
                          " FSDPX_GRACE_SECONDS, default 25)")
    run.add_argument("--device", choices=DEVICES, default=d.device,
                     help="where the model, optimizer state and batches live: cpu, cuda (one GPU per process,"
                          " cuda:LOCAL_RANK, NCCL between processes) or auto (cuda when there is a GPU for every"
                          " process); a resume asks anew (default %(default)s)")
    run.add_argument("--precision", choices=PRECISIONS + ("fp16",), default=d.precision,
                     help="what the forward and backward compute in: fp32, or bf16 (autocast; master weights,"
                          " AdamW moments, per-example norms, clipping and noise stay fp32); fp16 is refused"
                          " (default %(default)s)")

    model = p.add_argument_group("model and optimizer")
    model.add_argument("--n-layer", type=_positive_int, metavar="N", default=d.n_layer, help="(default %(default)s)")
    model.add_argument("--n-embd", type=_positive_int, metavar="N", default=d.n_embd, help="(default %(default)s)")
    model.add_argument("--n-head", type=_positive_int, metavar="N", default=d.n_head, help="(default %(default)s)")
    model.add_argument("--block-size", type=_positive_int, metavar="N", default=d.block_size,
                       help="characters per example (default %(default)s)")
    model.add_argument("--lr", type=_non_negative_float, metavar="X", default=d.lr,
                       help="learning rate of the optimizer (default %(default)s)")
    model.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                       help="adamw (torch's AdamW defaults, weight decay 0.01) or sgd (torch's SGD, with"
                            " --momentum); a resume keeps it (default %(default)s)")
    model.add_argument("--momentum", type=_unit_interval, metavar="X", default=d.momentum,
                       help="sgd's heavy-ball momentum in [0, 1), e.g. 0.9 (default %(default)s)")
    model.add_argument("--freeze", metavar="SPEC", default=None,
                       help="freeze parameters for a span of steps: 'wte,wpe@0-100;lm_head@50-' (names,"
                            " tied aliases or modules; start <= step < stop; a bare name: the whole run)")

    dp = p.add_argument_group("privacy")
    noise = dp.add_mutually_exclusive_group()
    noise.add_argument("--target-epsilon", type=_positive_float, metavar="X", default=None,
                       help=f"calibrate the noise to spend this epsilon over --steps (default {d.target_epsilon:g})")
    noise.add_argument("--noise-multiplier", type=_non_negative_float, metavar="X", default=None,
                       help="noise std / clip norm, instead of --target-epsilon")
    noise.add_argument("--non-private", action="store_true",
                       help="plain training on the same batches: no clipping, no noise, no guarantee")
    dp.add_argument("--delta", type=_open_unit, metavar="X", default=d.delta, help="(default %(default)g)")
    dp.add_argument("--clip-norm", type=_positive_float, metavar="X", default=d.clip_norm,
                    help="per-example gradient norm bound (default %(default)g)")
    batch = dp.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=_positive_float, metavar="X", default=None,
                       help=f"EXPECTED Poisson batch size (default {d.batch_size:g})")
    batch.add_argument("--sample-rate", type=_half_open_unit, metavar="X", default=None,
                       help="Poisson inclusion probability, instead of --batch-size")
    dp.add_argument("--method", choices=("auto", "ghost", "vmap"), default=d.method,
                    help="per-example norms (default %(default)s)")
    dp.add_argument("--clipping", choices=("flat", "automatic"), default=d.clipping, help="(default %(default)s)")
    dp.add_argument("--epsilon-budget", type=_positive_float, metavar="X", default=None,
                    help="stop before a step that would spend more than this (default: the target epsilon; a"
                         " resumed run's remaining noise is calibrated so the whole run stays within it)")
    dp.add_argument("--accountant", choices=("pld", "rdp"), default=d.accountant, help="(default %(default)s)")
    dp.add_argument("--noise-mechanism", choices=("independent", "banded", "blt"), default=d.noise_mechanism,
                    help="independent (DP-SGD), banded matrix-factorization noise correlated over --bands steps, or"
                         " buffered linear Toeplitz (blt) noise from --buffers buffers, both with cyclic Poisson"
                         " batches (privacy.mechanisms; default %(default)s)")
    dp.add_argument("--bands", type=_positive_int, metavar="B", default=None,
                    help="bands of --noise-mechanism banded (an example is sampled at most once every B steps)")
    dp.add_argument("--buffers", type=_positive_int, metavar="D", default=None,
                    help="buffers of --noise-mechanism blt: D parameter-sized float64 buffers carry its correlation")
    dp.add_argument("--min-separation", type=_positive_int, metavar="B", default=None,
                    help="--noise-mechanism blt: an example is sampled at most once every B steps (cyclic groups;"
                         " default 1); its epsilon counts ceil(steps / B) participations, without amplification")
    dp.add_argument("--audit-canaries", type=_positive_int, metavar="M", default=None,
                    help="audit the run: M gradient canaries, each in with probability 1/2, ride in its batches; the"
                         " summary ends with the epsilon lower bound their scores prove (privacy.audit)")
    dp.add_argument("--max-noise-multiplier", type=_positive_float, metavar="X", default=d.max_noise_multiplier,
                    help="refuse (before training) a target that needs more noise than this (default %(default)g)")

    shard = p.add_argument_group("sharding")
    shard.add_argument("--strategy", choices=STRATEGIES, default=None,
                       help="shard the run over --nproc local processes (torchrun is launched for you)")
    shard.add_argument("--nproc", type=_positive_int, metavar="N", default=None,
                       help="processes of a sharded run (default 2 with --strategy)")
    shard.add_argument("--tp", type=_positive_int, metavar="N", default=d.tp,
                       help="tensor-parallel degree: Megatron's layout of the GPT over N of the --nproc processes,"
                            " the strategy over the rest (default %(default)s)")
    shard.add_argument("--sequence-parallel", action="store_true",
                       help="with --tp: split the activations between tensor-parallel regions along the sequence")
    shard.add_argument("--pp", type=_positive_int, metavar="N", default=d.pp,
                       help="pipeline degree: the GPT's blocks cut into stages over N of the --nproc processes"
                            " (default %(default)s)")
    shard.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                       help="with --pp: the pipeline schedule (default %(default)s)")
    shard.add_argument("--microbatches", type=_positive_int, metavar="N", default=d.microbatches,
                       help="with --pp: microbatches per step and data-parallel rank (default %(default)s)")
    shard.add_argument("--virtual-stages", type=_positive_int, metavar="N", default=d.virtual_stages,
                       help="with --pp and interleaved_1f1b: stages per process (default %(default)s)")

    off = p.add_argument_group("optimizer offload")
    off.add_argument("--offload", choices=("none", "zenflow", "zero"), default=d.offload,
                     help="zenflow: top columns on the device each step, the rest on the host (default %(default)s)")
    off.add_argument("--offload-topk", type=_half_open_unit, metavar="X", default=d.offload_topk,
                     help="ZenFlow: fraction of columns updated every step (default %(default)s)")
    off.add_argument("--offload-interval", type=_interval, metavar="N|auto", default=d.offload_interval,
                     help="ZenFlow: steps between host updates, or auto (when the window's gradient is coherent;"
                          " DeepSpeed's update_interval) (default %(default)s)")
    off.add_argument("--offload-select-strategy", choices=SELECT_STRATEGIES, default=d.offload_select_strategy,
                     help="ZenFlow: reselect columns every --offload-select-interval steps (step) or epochs (epoch),"
                          " or every epoch (auto, DeepSpeed's default) (default %(default)s)")
    off.add_argument("--offload-select-interval", type=_interval, metavar="N|auto", default=None,
                     help="ZenFlow: steps (step) or epochs (epoch) between reselections; auto with step: when the"
                          " selection holds under 90%% of the best columns' mass (default: step 100, epoch 1)")
    off.add_argument("--offload-full-warm-up-rounds", type=_non_negative_int, metavar="N",
                     default=d.offload_full_warm_up_rounds,
                     help="ZenFlow: the first N steps update every parameter, as plain AdamW (for training from"
                          " scratch) (default %(default)s)")
    off.add_argument("--offload-overlap-step", action=argparse.BooleanOptionalAction, default=d.offload_overlap_step,
                     help="ZenFlow: run the host window beside the next steps (the same bits either way)"
                          " (default %(default)s)")
    off.add_argument("--offload-host-process", action=argparse.BooleanOptionalAction, default=d.offload_host_process,
                     help="ZenFlow: run that host window in a worker process of its own instead of a thread of the"
                          " training process (the same bits; no GIL shared with the loop; on a host with few cores"
                          " run it with OMP_WAIT_POLICY=PASSIVE: docs/performance.md) (default %(default)s)")
    off.add_argument("--offload-host-threads", type=_positive_int, metavar="N", default=d.offload_host_threads,
                     help="with --offload-host-process: the worker's intra-op threads (default %(default)s)")
    off.add_argument("--offload-host-cores", metavar="CPUS", default=d.offload_host_cores,
                     help="with --offload-host-process: pin the worker to these CPUs, e.g. 2-7 or 0,2"
                          " (default: not pinned)")
    off.add_argument("--deepspeed-config", metavar="DS.JSON", default=None,
                     help="a DeepSpeed config: its zero_optimization.zenflow and offload_optimizer blocks set the"
                          " offload flags above (flags typed and config-file keys win over it)")

    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--ckpt-dir", metavar="DIR", default=None, help="save checkpoints here (atomic, async)")
    ck.add_argument("--ckpt-every", type=_positive_int, metavar="N", default=d.ckpt_every,
                    help="steps between checkpoints (default %(default)s)")
    resume = ck.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the newest intact checkpoint in --ckpt-dir (flags not given are the"
                             " checkpoint's run's); refused when there is none")
    resume.add_argument("--resume-if-present", action="store_true",
                        help="--resume when --ckpt-dir holds a checkpoint, else start the run there (for schedulers"
                             " and elastic restarts; the run directory is the run's own and may exist)")
    resume.add_argument("--resume-from", metavar="PATH", default=None,
                        help="branch: a new run (--name) from any intact checkpoint (DIR/step_N, or a root: its newest),"
                             " with its own checkpoints (default OUT/NAME/ckpt); flags not given are the source's")
    ck.add_argument("--allow-budget-increase", action="store_true",
                    help="on resume: accept a larger --target-epsilon / --epsilon-budget or --delta than the run"
                         " promised (recorded in its segments)")
    ck.add_argument("--allow-new-data", action="store_true",
                    help="on resume: accept data other than the checkpoint was trained on")
    ck.add_argument("--max-restarts", type=_non_negative_int, metavar="N", default=None,
                    help="with --strategy and --ckpt-dir: when a worker fails, torchrun restarts them all, up to N"
                         " times, and they resume from the newest intact checkpoint (default 0)")


def _add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The config file, and what the run trains (``fsdpx.train.sources``)."""
    d = _DEFAULTS
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a TOML file of the run's settings (sections run, model, data, eval, privacy, parallelism,"
                        " offload, checkpoints, logging; every key is also a flag, and flags override it)")
    model = p.add_argument_group("your own model (default: the built-in GPT above)")
    model.add_argument("--model", choices=MODEL_KINDS, default=d.model,
                       help="gpt, a transformers causal LM by --model-path or --model-class, or python: your own"
                            " --model-fn, --data-fn and --loss-fn (default %(default)s)")
    model.add_argument("--model-path", metavar="PATH", default=None,
                       help="transformers: a local directory holding config.json (or the file); never downloaded")
    model.add_argument("--model-class", metavar="NAME", default=None,
                       help="transformers: a config or causal-LM class, e.g. GPT2Config or LlamaForCausalLM")
    model.add_argument("--model-fields", type=_table, metavar="TABLE", default=None,
                       help="transformers: config fields, e.g. 'n_embd = 32, n_layer = 2' (over --model-path's)")
    model.add_argument("--lora", type=_table, metavar="TABLE", default=None,
                       help="transformers: train LoRA adapters only, e.g. 'r = 8, alpha = 16, targets = [\"q_proj\","
                            " \"v_proj\"]' (keys r, alpha, targets, dropout = 0, merge: export the merged model)")
    model.add_argument("--vocab-size", type=_positive_int, metavar="N", default=None,
                       help="the built-in GPT's vocabulary (default: the data's)")
    model.add_argument("--model-fn", metavar="MODULE:NAME", default=None,
                       help="python: model_fn(hparams) -> nn.Module, importable by every process")
    model.add_argument("--loss-fn", metavar="MODULE:NAME", default=None,
                       help="python: loss_fn(output, targets) -> per-example losses (B,)")
    model.add_argument("--hparams", type=_table, metavar="TABLE", default=None,
                       help="python: the table passed to model_fn and data_fn, e.g. 'width = 32'")
    source = p.add_argument_group("your own data (default: the embedded corpus)")
    source.add_argument("--data", choices=DATA_KINDS, default=d.data,
                        help="the kind of --data-path; auto: .npy, .bin, a directory is a saved datasets dataset,"
                             " any other file text (default %(default)s)")
    source.add_argument("--data-path", metavar="PATH", default=None, help="the data file or dataset directory")
    source.add_argument("--data-fn", metavar="MODULE:NAME", default=None,
                        help="python: data_fn(hparams) -> (inputs, targets), the whole dataset")
    source.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="'bytes' or a local directory with a saved tokenizer (default: bytes for text)")
    source.add_argument("--data-dtype", choices=TOKEN_DTYPES, default=d.data_dtype,
                        help="token type of a raw .bin file (default %(default)s)")
    source.add_argument("--data-column", metavar="NAME", default=None,
                        help="a dataset's column of text or token ids (default: input_ids, else text)")
    source.add_argument("--data-split", metavar="NAME", default=d.data_split,
                        help="a saved DatasetDict's split (default %(default)s)")
    held = p.add_argument_group("held-out evaluation (no privacy budget spent)")
    held.add_argument("--eval-data", metavar="PATH", default=None,
                      help="a file held out from training, read like --data-path (same kind, tokenizer and"
                           " --block-size): its mean token loss and perplexity go into metrics.jsonl (eval_loss,"
                           " eval_ppl), the progress bar, the summary and plot.png. Forward only: no gradient, noise"
                           " or accountant, so it spends no privacy budget; it must not be training data (the"
                           " training file itself is warned about)")
    held.add_argument("--eval-every", type=_positive_int, metavar="N", default=None,
                      help="with --eval-data: evaluate every N steps and at the last step")
    held.add_argument("--eval-batches", type=_positive_int, metavar="K", default=d.eval_batches,
                      help="batches evaluated each time, the same evenly spaced examples every time and in every"
                           " layout (default %(default)s)")
    held.add_argument("--eval-batch-size", type=_positive_int, metavar="B", default=None,
                      help="examples per evaluated batch (default: the expected --batch-size)")
    p.add_argument("--accounting-interval", type=_positive_float, metavar="X", default=d.accounting_interval,
                   help="PLD discretization: coarser is faster and still an upper bound (default %(default)g)")


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="fsdpx", description=__doc__.splitlines()[0],
        epilog="also: 'fsdpx jobs plan|run ...' (many jobs at once; fsdpx jobs --help), 'fsdpx schedule KIND"
               " --ranks P --microbatches M' (a pipeline schedule simulated and drawn; fsdpx schedule --help) and"
               " 'fsdpx export CKPT --to OUT' (a checkpoint's model for transformers; fsdpx export --help)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser("train", help="train a model privately (default: the small GPT on the embedded"
                                " corpus)", description="Train a model with DP-SGD: the small GPT on the embedded"
                                " corpus, or your own model and data (--config run.toml).")
    _add_train_arguments(train)
    _add_source_arguments(train)
    train.set_defaults(command_parser=train)  # its .error() prefixes messages with "fsdpx train"
    return parser


def config_from_args(args: argparse.Namespace, explicit: set[str] | None = None,
                     file: dict[str, Any] | None = None) -> RunConfig:
    """The :class:`RunConfig` the parsed flags describe: the flags in ``explicit`` (those typed on
    the command line; all of them when ``None``) over the config file's ``file`` values
    (:func:`fsdpx.train.config.merge`), and both over what a ``deepspeed_config`` file sets
    (:mod:`fsdpx.train.deepspeed`: ``--deepspeed-config ds.json --offload-topk 0.2`` takes
    every ZenFlow key from the file but the top-k), defaults from ``RunConfig``.

    With ``resume`` or ``resume_from`` and a checkpoint whose root records its run
    (``run.json``), what the flags and the file set overrides the configuration that wrote the
    checkpoint, and the rest keeps its values (:func:`fsdpx.train.resume.segment_config`):
    ``--resume-from ck/step_10 --lr 3e-3 --name b`` changes only the learning rate
    (``tests/test_train_segments.py::test_a_cli_branch_keeps_the_flags_it_does_not_set``)."""
    fields = {*FIELDS, "config_file"}
    flags = {k: v for k, v in vars(args).items()
             if k in fields and v is not None and (explicit is None or k in explicit)}
    if explicit is None or "non_private" in explicit:
        flags["private"] = not args.non_private
    if args.config is not None:
        flags["config_file"] = str(Path(args.config).resolve())
    values = merge({k: v for k, v in (file or {}).items() if k in fields}, flags)
    if values.get("deepspeed_config"):  # under the flags and the file's keys
        values = {**read_deepspeed(values["deepspeed_config"]).values, **values}
    resuming = values.get("resume") or values.get("resume_if_present")
    source = values.get("resume_from") or (values.get("ckpt_dir") if resuming else None)
    if source is not None and explicit is not None:
        from .resume import segment_config, source_config  # reads checkpoints: loads torch

        base = source_config(source)
    else:
        base = None
    if base is None:
        values.setdefault("name", "private" if values.get("private", True) else "non-private")
        return RunConfig.of(**values)
    return segment_config(base, values)


def file_checks(parser: argparse.ArgumentParser) -> dict[str, Callable[[Any], Any]]:
    """The flags' own value checks (ranges, choices) for the same keys in a config file."""
    checks = {}
    for action in parser._actions:
        if action.choices is not None:
            checks[action.dest] = lambda v, c=tuple(action.choices): _choose(v, c)
        elif action.type in _VALUE_CHECKS:
            checks[action.dest] = lambda v, t=action.type: t(str(v))
    return checks


def _choose(value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"invalid choice {value!r} (choose from {', '.join(map(repr, choices))})")


def explicit_flags(argv: list[str]) -> set[str]:
    """The destinations of the ``fsdpx train`` flags typed in ``argv`` (not defaulted)."""
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # the one subcommand we add
    for action in train._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command", "command_parser"}


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command. Ends as
    :mod:`fsdpx.train.reports` says, one line on stderr: exit status 2 for bad flags or values
    the privacy core rejects (refusals), 1 for a failure while training (a checkpoint that could
    not be saved), 130 and 143 for SIGINT and SIGTERM (:mod:`fsdpx.train.interrupts`: the step
    under way finishes; SIGTERM writes its checkpoint), the same in a sharded run."""
    from .interrupts import handling

    with handling():  # from the first moment: a signal is a request to stop after the step under way
        _main(argv)


def _main(argv: list[str] | None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.verbose:
        from .reports import VERBOSE

        os.environ[VERBOSE] = "1"  # the launcher, its agent and the workers see it
    explicit = explicit_flags(argv)
    file = config = None
    try:
        file = read_file(args.config, checks=file_checks(args.command_parser)) if args.config else {}
        nproc = args.nproc if "nproc" in explicit else file.get("nproc")
        progress = not args.no_progress if "no_progress" in explicit else file.get("progress", True)
        config = config_from_args(args, explicit, file)
        max_restarts = args.max_restarts if "max_restarts" in explicit else file.get("max_restarts", 0)
        layout = config.parallelism
        if nproc is not None and not layout.sharded:
            args.command_parser.error("--nproc needs --strategy (ddp, zero1, zero2, zero3 or hsdp)")
        if max_restarts and (not layout.sharded or config.checkpoints.ckpt_dir is None):
            args.command_parser.error("--max-restarts needs --strategy (torchrun restarts the workers) and --ckpt-dir"
                                      " (a restarted worker resumes from its newest intact checkpoint)")
        # the values check out: now the heavy modules (torch, the privacy core, the runtime)
        from .build import check_layout
        from .device import run_device
        from .launch import restart_count, watch_launcher
        from .resume import restarted_config

        if "WORLD_SIZE" not in os.environ:  # the launcher (or the one process): refuse before any process or file
            from .preflight import check_before_writing

            if layout.sharded:
                nproc = nproc or 2 * layout.tp * layout.pp
                check_layout(config, nproc)  # what cannot run here, before any process starts
            check_before_writing(config)  # then what would touch the user's files
            _note_unread_deepspeed(config)
            if layout.sharded:
                _stop_if_asked(config)  # a Ctrl-C while the checks ran: start nothing
                sys.exit(_launch(argv, nproc, max_restarts))  # re-run this very command on N processes
        if layout.sharded:
            watch_launcher()  # a worker of `fsdpx train --nproc`: never outlive the launcher
            config = restarted_config(config, restart_count())  # torchrun restarted us: resume
        else:
            run_device(config.run.device)  # cuda without a GPU: refused before anything is printed or written
        comm = _communicator(config)
        if comm is None or comm.rank == 0:
            print(_plan_line(config, comm), file=sys.stderr)
        summary = run(config, progress=progress, comm=comm)
        if comm is not None:  # after a failure the error stands; a barrier could only hang
            from fsdpx.runtime.dist_comm import shutdown

            shutdown()
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - said in one line where it is not a bug (and once, sharded)
        _end(err, args, explicit, file, config)
    if comm is None or comm.rank == 0:
        from .report import format_summary

        print(format_summary(summary))


def _end(err: BaseException, args: argparse.Namespace, explicit: set[str], file: dict[str, Any] | None,
         config: RunConfig | None) -> NoReturn:
    """End the process as ``err`` calls for (:mod:`fsdpx.train.reports`): an interruption, a
    refusal, a failure while running or another rank's death is one line with its exit status;
    a bug keeps its traceback (a worker of the launcher hands it to the launcher, which shows the
    first failing rank's only). A worker of a sharded run exits at once (``os._exit``): its peers
    may be gone, so no barrier, and no teardown of a process group still alive."""
    from .errors import RunFailure
    from .interrupts import EXIT_CODES, Interrupted, line, where
    from .reports import announce

    worker = "WORLD_SIZE" in os.environ
    secondary, trace = False, None
    failure = sys.modules.get("fsdpx.sharding.comm")
    if isinstance(err, Interrupted):
        kind, detail, code = "interrupted", err.line, err.code
    elif isinstance(err, KeyboardInterrupt):  # a second Ctrl-C outside a step: where the loop is, if it began
        ckpt_dir = config.checkpoints.ckpt_dir if config is not None else None
        step, ckpt_dir, newest = where() or (None, ckpt_dir, _newest(ckpt_dir))
        kind, detail, code = "interrupted", line(step, ckpt_dir, newest), EXIT_CODES[signal.SIGINT]
    elif _refusal(err):
        kind, detail, code = "refusal", _in_their_words(err, args, explicit, file), 2
    elif isinstance(err, RunFailure):
        kind, detail, code = "failure", str(err), 1
    elif failure is not None and isinstance(err, failure.RankFailure):  # another rank died first
        kind, detail, code, secondary = "failure", str(err), 1, True
    elif worker and isinstance(err, Exception):
        first = (str(err).splitlines() or [""])[0]
        kind, detail, code, trace = "failure", f"{type(err).__name__}: {first}", 1, traceback.format_exc()
    else:
        raise err
    announce(kind, detail, code, secondary=secondary, traceback=trace)
    if worker:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _note_unread_deepspeed(config: RunConfig) -> None:
    """One line on stderr naming what the run's DeepSpeed file holds and fsdpx does not read."""
    path = config.offload.deepspeed_config
    unread = read_deepspeed(path).unread if path else []
    if unread:
        print(f"fsdpx train: --deepspeed-config {path}: not read (fsdpx's own settings apply): {', '.join(unread)}",
              file=sys.stderr)


def _stop_if_asked(config: RunConfig) -> None:
    """In the launcher, before torchrun starts: a signal already received ends the run here, as
    one process would (nothing was trained)."""
    from .interrupts import Interrupted, exit_code, line, requested

    signum = requested()
    if signum is not None:
        ckpt_dir = config.checkpoints.ckpt_dir
        raise Interrupted(line(None, ckpt_dir, _newest(ckpt_dir)), exit_code(signum))


def _newest(ckpt_dir: str | None) -> str | None:
    """The newest committed ``step_<N>`` under ``ckpt_dir`` (not verified), or ``None``."""
    if ckpt_dir is None:
        return None
    import ckpt

    steps = ckpt.CheckpointManager(ckpt_dir).steps()
    return str(Path(ckpt_dir) / f"step_{steps[-1]}") if steps else None


def _refusal(err: BaseException) -> bool:
    """Whether ``err`` refuses the user's values (printed as one line, exit 2), not a bug: a
    ``ConfigError``, ``privacy.errors.PrivacyError`` or ``fsdpx.train.segments.ResumeError``. The
    last two are looked up only once loaded (an error of a module not imported cannot have been
    raised), so a bad value answers before torch is imported."""
    kinds = [ConfigError] + [getattr(sys.modules[m], name) for m, name in
                             (("privacy.errors", "PrivacyError"), ("fsdpx.train.segments", "ResumeError"))
                             if m in sys.modules]
    return isinstance(err, tuple(kinds))


def _in_their_words(err: BaseException, args: argparse.Namespace, explicit: set[str],
                    file: dict[str, Any] | None) -> str:
    """A :class:`ConfigError`'s message naming each setting as the user gave it: the flag typed,
    the config file's key (:func:`fsdpx.train.wording.as_given`); a config file's own errors
    already name its keys, and other refusals are printed as raised."""
    from .config import ConfigFileError
    from .wording import as_given, spellings

    if not isinstance(err, ConfigError) or isinstance(err, ConfigFileError):
        return str(err)
    flags = {a.dest: max([o for o in a.option_strings if not o.startswith("--no-")] or a.option_strings, key=len)
             for a in args.command_parser._actions if a.option_strings}  # a switch by its own name, not --no-
    return as_given(str(err), spellings(flags, explicit, file if args.config else None))


def run(config: RunConfig, *, progress: bool = True, comm=None) -> dict[str, Any]:
    """:func:`fsdpx.train.run`, imported when first called: it loads torch."""
    from .loop import run as train

    return train(config, progress=progress, comm=comm)


def _launch(argv: list[str], nproc: int, max_restarts: int = 0) -> int:
    """Run ``fsdpx <argv>`` under torchrun on ``nproc`` local processes; returns its exit code.
    The equivalent one-liner: ``torchrun --standalone --nproc-per-node N [--max-restarts R] -m fsdpx
    train ...``."""
    from .launch import launch, torchrun_command

    rest = _drop_flag(argv, "--nproc")
    cmd = torchrun_command(nproc, ["fsdpx", *rest], module=True, max_restarts=max_restarts)
    print("fsdpx: launching " + " ".join(cmd[1:]), file=sys.stderr)
    return launch(cmd)  # its workers die with this process, however it dies


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _communicator(config: RunConfig):
    """This process's communicator in a torchrun-started sharded run, else None."""
    if not config.parallelism.sharded:
        return None
    from fsdpx.runtime.dist_comm import init_from_env

    from .device import torchrun_device

    device = torchrun_device(config.run.device)  # refused (no GPU for this rank) before the process group
    return init_from_env(config.parallelism.mesh(int(os.environ["WORLD_SIZE"])), device=device)


def _window_words(interval: int | str) -> str:
    return "when a window's gradient is coherent" if interval == "auto" else f"every {interval} steps"


def _warm_up_words(off: Any) -> str:
    """The header's words for ZenFlow's knobs beyond the top-k and the window, when not the defaults."""
    words = [f"after {off.offload_full_warm_up_rounds} steps of plain AdamW"] if off.offload_full_warm_up_rounds else []
    if off.offload_select_strategy != "step" or off.offload_select_interval is not None:
        every = off.offload_select_interval or (1 if off.offload_select_strategy != "step" else 100)
        unit = "steps" if off.offload_select_strategy == "step" else "epoch(s)"
        words.append(f"reselecting every {every} {unit}" if every != "auto" else "reselecting by coverage")
    return "".join(f", {w}" for w in words)


def _plan_line(config: RunConfig, comm=None) -> str:
    """The run's header on stderr: steps, model, data, privacy, layout, offload, device and where
    it writes (``tests/test_cli.py::test_the_run_header_names_the_offload``)."""
    p, m = config.privacy, config.model
    if not p.private:
        privacy = "non-private"
    elif p.target_epsilon is not None:
        privacy = f"DP-SGD to epsilon {p.target_epsilon:g} at delta {p.delta:g}"
    else:
        privacy = f"DP-SGD with noise multiplier {p.noise_multiplier:g}"
    if p.private and p.noise_mechanism == "banded":  # DP-SGD's step with banded matrix-factorization noise
        privacy = privacy.replace("DP-SGD", f"DP-SGD with banded noise ({p.bands} bands)", 1)
    if p.private and p.noise_mechanism == "blt":  # DP-SGD's step with buffered Toeplitz noise
        words = f"DP-SGD with BLT noise ({p.buffers} buffers, min separation {p.groups})"
        privacy = privacy.replace("DP-SGD", words, 1)
    where = f", {config.parallelism.strategy} on {comm.mesh}" if comm is not None else ""
    off = config.offload
    where += {"none": "", "zero": ", ZeRO-Offload (the optimizer on the host)",
              "zenflow": f", ZenFlow offload (the top {off.offload_topk:.0%} of columns each step, the rest on the host"
                         f" {_window_words(off.offload_interval)}{_warm_up_words(off)})"}[off.kind]
    if config.run.device != "cpu":
        where += f", on {comm.device if comm is not None else config.run.device}"
    model = {"gpt": f"GPT {m.n_layer} layers x {m.n_embd}", "python": f"{m.model_fn}",
             "transformers": f"transformers {m.model_class or m.model_path}"}[m.kind]
    if m.lora is not None:
        model += f" (LoRA adapters of rank {m.lora['r']} alone)"
    data = config.data.data_fn or config.data.data_path or "the embedded corpus"
    if config.eval.enabled:
        data += f" (held out: {config.eval.eval_data}, evaluated every {config.eval.eval_every} steps and at the last)"
    return f"fsdpx train: {config.run.steps} steps, {model} on {data}, {privacy}{where} -> {config.run_dir}"
