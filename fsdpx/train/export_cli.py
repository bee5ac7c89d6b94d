"""``fsdpx export CKPT --to OUT``: the model of any checkpoint as a directory that loads without
fsdpx (:mod:`fsdpx.train.export` says the formats).

    fsdpx export runs/ft/ckpt/step_20 --to my-model          # or the root: its newest intact checkpoint
    fsdpx export runs/ft/ckpt --to my-model --overwrite
    fsdpx export runs/lora/ckpt --to merged --merge            # a LoRA run: the merged model, not the adapter

The model is the one the checkpoint's run record (``run.json`` beside it) names, built with its
parameters on ``meta`` (nothing initialised, no weights read); each parameter is then read whole
from the checkpoint, one at a time, whatever layout wrote it (one process, ZeRO, tensor or
pipeline parallel): the optimizer's state is never read. Refusals, one line and exit status 2,
nothing written: a path that is not a checkpoint, a checkpoint without its record, a model
without a format, an ``OUT`` that exists and is not empty (without ``--overwrite``). A write
that fails (a full disk) is one line and exit status 1, ``OUT`` as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

from .errors import ConfigError
from .flags import FlagParser

PROG = "fsdpx export"


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog=PROG, description="Write the model of a checkpoint as a directory that"
                                " transformers (or fsdpx.train.export.load_gpt, for the built-in GPT) loads.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint (step_<N>) or a checkpoint root (its newest"
                   " intact checkpoint)")
    p.add_argument("--to", metavar="OUT", required=True, help="the directory to write (must not hold files)")
    p.add_argument("--overwrite", action="store_true", help="replace what OUT holds")
    p.add_argument("--merge", action="store_true", help="a LoRA run's checkpoint: write the base model with the"
                   " adapters merged (for from_pretrained), not the adapter (for peft.PeftModel.from_pretrained)")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (before torch is imported: ``--help`` and a missing ``--to`` answer at once)
    and export; a refusal is one line and exit status 2, a failed write one line and 1."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    import ckpt
    from safetensors import SafetensorError

    from .segments import ResumeError

    try:
        out = export_checkpoint(args.checkpoint, args.to, overwrite=args.overwrite, merge=args.merge)
    except (ConfigError, ResumeError, ckpt.CheckpointError) as err:
        print(f"{PROG}: error: {(str(err).splitlines() or [''])[0]}", file=sys.stderr)
        sys.exit(2)
    except (OSError, SafetensorError) as err:  # OUT could not be written (a full disk): nothing left there
        print(f"{PROG}: error: {args.to} not written: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"{PROG}: wrote {out}", file=sys.stderr)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False,
                      merge: bool = False) -> Path:
    """Export the model of ``checkpoint`` into ``out`` (see the module doc); returns ``out``.

    Guarantees: the files equal those the run would have exported at the step of the checkpoint,
    in any layout it was written in (``tests/test_export.py``); a LoRA run's checkpoint gives its
    adapter, or with ``merge`` the merged model (``tests/test_lora_cli.py``). Every refusal is
    raised before anything is written."""
    import ckpt

    from .export import check_target, write_export
    from .pretrained import parameters_on_meta
    from .resume import find_checkpoint, source_config
    from .sources import build_model

    path, out = find_checkpoint(Path(checkpoint)), Path(out)
    check_target(out, overwrite=overwrite)
    config = source_config(path)
    if config is None:
        raise ConfigError(f"{path}: no run record (run.json) beside the checkpoint names its model, so it cannot be"
                          " exported")
    if config.model.kind == "python":
        raise ConfigError(f"{path}: the model is your own (model = \"python\"); fsdpx has no format to export it in")
    manifest = ckpt.read_manifest(path)
    wte = manifest.tensors.get("params/wte.weight")
    vocab = (wte.param_shape or wte.shape)[0] if wte is not None else None
    with parameters_on_meta():  # nothing initialised and no pretrained weights read: the checkpoint has them
        model, _ = build_model(config, vocab or 0, read="none")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    params = dict(_checked(ckpt.read_whole(path, "params"), shapes, path))
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise ConfigError(f"{path}: the checkpoint has no params/{missing[0]} ({len(missing)} of the model's"
                          " parameters missing)")
    return write_export(model, params, out, overwrite=overwrite, merge=merge)


def _checked(tensors: Iterator, shapes: dict[str, tuple[int, ...]], path: Path) -> Iterator:
    for name, tensor in tensors:
        if shapes.get(name) != tuple(tensor.shape):
            raise ConfigError(f"{path}: params/{name} of shape {tuple(tensor.shape)} is not a parameter of the"
                              f" recorded model ({shapes.get(name)})")
        yield name, tensor

