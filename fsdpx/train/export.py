"""A trained model as a directory that loads without fsdpx's training code: at the end of a run
(``runs/NAME/model/``, on by default, ``--no-export`` to skip) or from any checkpoint
(``fsdpx export CKPT --to OUT``, :mod:`fsdpx.train.export_cli`).

    write_export(source.model, params, Path("runs/a/model"))          # atomic; refuses a non-empty OUT
    transformers.AutoModelForCausalLM.from_pretrained("runs/a/model")  # a transformers model
    model = load_gpt("runs/a/model")                                   # the built-in GPT

Formats:

* a transformers model: what its ``save_pretrained`` writes, called on the model holding the
  trained tensors (no copy): ``config.json`` (``use_cache`` back to the class's default, ``dtype``
  float32), ``generation_config.json``, and ``model.safetensors`` (or shards and their index,
  past transformers' shard size) holding every parameter once under its ``state_dict`` name (a
  tied head, GPT-2's ``lm_head.weight``, is not duplicated: transformers ties it on load); fp32,
  as trained. ``fsdpx train --model transformers --model-path OUT`` starts from it again.
* the built-in GPT (``fsdpx.models.gpt``): ``model.safetensors`` of its parameters (the tied
  ``lm_head.weight`` is ``wte.weight``, stored once) and ``gpt_config.json``, the fields of its
  ``GPTConfig`` plus ``"format": "fsdpx-gpt"``; :func:`load_gpt` builds it back.
* a transformers model with LoRA adapters (``--lora``, :mod:`fsdpx.train.lora_model`): the
  adapter as ``PeftModel.save_pretrained`` writes it (``adapter_config.json``, naming the base
  model's path, and ``adapter_model.safetensors``), loadable by ``peft.PeftModel.from_pretrained(base,
  OUT)``; with ``merge`` (``[model.lora] merge = true``, ``fsdpx export --merge``) the base model
  with the adapters merged into its weights, in the transformers format above.
* your own model (``model = "python"``): no format; not exported at the end of a run, and
  ``fsdpx export`` refuses it by name (:class:`NotExportableError`).

Cost: a sharded run already gathers the whole parameters on every rank at its end (for the
sample); the export adds rank 0 writing them once (fp32: 4 bytes per parameter). For a model too
large to write at every run's end, ``--no-export``, then ``fsdpx export`` from a checkpoint, which
reads one parameter at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor, nn

from fsdpx.models.gpt import GPT, GPTConfig

from .errors import ConfigError, RunFailure
from .lora_model import is_lora, merged_model, write_adapter

MODEL_DIR = "model"  # beside metrics.jsonl in the run directory
WEIGHTS = "model.safetensors"
GPT_CONFIG = "gpt_config.json"
GPT_FORMAT = "fsdpx-gpt"


class ExportExistsError(ConfigError):
    """The export's directory exists and holds files (``--overwrite`` to replace them)."""


class NotExportableError(ConfigError):
    """The model has no export format (your own ``nn.Module``: save its parameters yourself)."""


def exportable(model: nn.Module) -> bool:
    """Whether ``model`` has an export format: the built-in GPT or a transformers model."""
    return isinstance(model, GPT) or callable(getattr(model, "save_pretrained", None))


def check_target(out: Path, *, overwrite: bool) -> None:
    """Raise :class:`ExportExistsError` if ``out`` is a file, or a directory holding anything
    while ``overwrite`` is off. Writes nothing."""
    if out.exists() and not out.is_dir():
        raise ExportExistsError(f"{out} is a file, not a directory to export the model into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")


def write_export(model: nn.Module, params: Mapping[str, Tensor], out: str | Path, *,
                 overwrite: bool = False, merge: bool = False) -> Path:
    """Write ``model`` with the values ``params`` (``{canonical parameter name: whole tensor}``,
    as ``named_parameters()`` names them) into the directory ``out`` in its format (module doc).
    ``model``'s own parameter values are not read (they may be on ``meta``); its config and
    persistent buffers are; it is left as it was.

    Guarantees:
      * atomic: the files are written into a temporary directory beside ``out``, then renamed
        to ``out``; a failure leaves ``out`` as it was (an old export replaced with
        ``overwrite`` included) and no temporary directory;
      * a non-empty ``out`` without ``overwrite`` raises :class:`ExportExistsError` before anything
        is written; a model without a format :class:`NotExportableError`;
      * the stored tensors equal ``params`` bit for bit, fp32 as trained
        (``tests/test_export.py::test_a_run_at_lr_0_exports_exactly_the_weights_it_loaded``);
      * a model with LoRA adapters (``lora``, :mod:`fsdpx.train.lora_model`) is written as its
        adapter in peft's format, or with ``merge`` as the merged transformers model; ``merge``
        for a model without adapters is a :class:`ConfigError` before anything is written.
    """
    out = Path(out)
    if not exportable(model):
        raise NotExportableError(f"{type(model).__name__} is not a transformers model nor the built-in GPT: fsdpx has"
                                 " no format to export it in (its parameters are the checkpoint's params/ tensors)")
    lora = is_lora(model)
    if merge and not lora:
        raise ConfigError(f"--merge merges LoRA adapters into their base model; this {type(model).__name__} has none"
                          " (its export is already the whole model)")
    check_target(out, overwrite=overwrite)
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"no value for the parameters {missing[:3]} of {type(model).__name__}")
    tensors = {n: params[n].detach().to("cpu").contiguous() for n in names}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        if isinstance(model, GPT):
            _write_gpt(model, tensors, tmp)
        elif lora and not merge:
            write_adapter(model, tensors, tmp)
        elif lora:
            _write_transformers(*merged_model(model, tensors), tmp)
        else:
            _write_transformers(model, tensors, tmp)
        _sync(tmp)
        if out.exists():
            os.rename(out, old)  # an empty directory, or an export replaced with overwrite
        try:
            os.rename(tmp, out)
        except BaseException:
            if old.exists() and not out.exists():
                os.rename(old, out)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def _write_transformers(model: nn.Module, tensors: dict[str, Tensor], where: Path) -> None:
    """transformers' own ``save_pretrained`` of ``model`` holding ``tensors``: its key names, tied
    keys, shards and config are transformers' (a family whose file layout differs from its
    modules' is written as transformers writes it). Its progress bar and warnings are not shown:
    a finished run ends in one summary."""
    with _holding(model, tensors), contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(str(where))


@contextlib.contextmanager
def _holding(model: nn.Module, tensors: Mapping[str, Tensor]) -> Iterator[None]:
    """Inside: ``model``'s parameters are ``tensors`` (no copy; tied parameters stay one) and its
    config's ``use_cache`` is the class's default (the run turned it off: a training forward needs
    no cache, a user's generation does); after: both as they were."""
    new = {id(p): nn.Parameter(tensors[name], requires_grad=False) for name, p in model.named_parameters()}
    swapped = []
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                swapped.append((module, key, p))
                module._parameters[key] = new[id(p)]
    config, use_cache = model.config, getattr(model.config, "use_cache", None)
    config.use_cache = _default_use_cache(config)
    try:
        yield
    finally:
        config.use_cache = use_cache
        for module, key, p in swapped:
            module._parameters[key] = p


def _default_use_cache(config: object) -> bool:
    try:
        return bool(getattr(type(config)(), "use_cache", True))
    except Exception:  # noqa: BLE001 - a config class that needs arguments: transformers' own default
        return True


def _write_gpt(model: GPT, tensors: dict[str, Tensor], where: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(where / WEIGHTS), metadata={"format": "pt"})
    (where / GPT_CONFIG).write_text(json.dumps({"format": GPT_FORMAT, **dataclasses.asdict(model.config)},
                                               indent=2) + "\n")


def _sync(directory: Path) -> None:
    """The files' bytes on disk before the rename makes them the export, readable as any file the
    user writes (safetensors creates its file private to the owner)."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_gpt(path: str | Path) -> GPT:
    """The built-in GPT an export holds (``gpt_config.json`` + ``model.safetensors``), its
    parameters the file's bit for bit (the tied head is ``wte.weight``). Raises
    :class:`ConfigError` naming the path for a directory that is not such an export, or whose
    tensors are not the config's parameters."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        fields = json.loads((path / GPT_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: no readable {GPT_CONFIG} (not an export of the built-in GPT): {e}") from None
    if fields.pop("format", None) != GPT_FORMAT:
        raise ConfigError(f"{path / GPT_CONFIG}: not of the format {GPT_FORMAT!r}")
    model = GPT(GPTConfig(**fields))
    tensors = load_file(str(path / WEIGHTS))
    names = {n for n, _ in model.named_parameters()}
    if set(tensors) != names:
        raise ConfigError(f"{path / WEIGHTS}: its tensors {sorted(set(tensors) ^ names)[:3]} differ from the GPT's"
                          " parameters")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name])
    return model


def export_at_end(model: nn.Module, params: Mapping[str, Tensor], run_dir: Path, *, main: bool,
                  comm: Any = None, merge: bool = False) -> Path | None:
    """The end of a run: rank 0 (``main``) writes ``run_dir/model`` (replacing an earlier
    segment's export; ``merge``: a LoRA model's merged model, not its adapter); every rank learns
    whether it was written. Returns the directory, ``None``
    for a model without a format (nothing written). A write that fails raises
    :class:`fsdpx.train.errors.RunFailure` on every rank, one line naming the directory, the
    cause and how to export later; everything else the run wrote (metrics, plot, checkpoints)
    is kept (``tests/test_export.py::test_an_export_that_fails_is_one_line_and_keeps_the_metrics``)."""
    if not exportable(model):
        return None
    out = run_dir / MODEL_DIR
    failed = None
    if main:
        try:
            write_export(model, params, out, overwrite=True, merge=merge)
        except Exception as err:  # noqa: BLE001 - an OSError, safetensors' own error on a full disk, ...: one line
            failed = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    if comm is not None:
        failed = next((f for f in comm.all_gather_object(failed) if f is not None), None)
    if failed is not None:
        raise RunFailure(f"the model was not exported to {out}: {failed}; the run's metrics and checkpoints are kept"
                         f" in {run_dir} (export a checkpoint later: fsdpx export CKPT --to DIR)")
    return out
