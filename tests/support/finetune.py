"""What the fine-tuning tests share (``tests/test_export.py``, ``tests/test_lora_cli.py``,
``tests/test_finetune_chain.py``): tiny transformers models saved with ``save_pretrained`` (a tied
GPT-2 and a grouped-query Llama, nothing downloaded), the real CLI in a subprocess, and the
logits of a run's final parameters against those of what transformers loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 80  # the embedded corpus's alphabet (69) fits
SMALL = ["--corpus-chars", "2000", "--block-size", "8", "--batch-size", "8", "--no-progress"]


def tiny(family: str):
    """A seeded tiny ``GPT2LMHeadModel`` (tied head, dropout 0) or ``LlamaForCausalLM``."""
    import transformers

    torch.manual_seed(1)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def saved(model, path: Path) -> Path:
    """``model.save_pretrained(path)``; returns ``path``."""
    model.save_pretrained(str(path))
    return path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``path/model.safetensors`` (or of ``path``, a safetensors file)."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors" if path.is_dir() else path))


def last_checkpoint(ckpt_dir: Path) -> Path:
    return max(ckpt_dir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def checkpoint_params(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The parameters of the run's last checkpoint, whole, whatever layout wrote them."""
    import ckpt

    return dict(ckpt.read_whole(last_checkpoint(ckpt_dir), "params"))


def final_logits(ckpt_dir: Path, x: torch.Tensor) -> torch.Tensor:
    """The logits on ``x`` of the model fsdpx built (the run's recorded configuration) holding
    the parameters of the run's last checkpoint, restored in one process by ``resume_from`` (not
    by the export's own reading), in eval mode."""
    from torch.func import functional_call

    from fsdpx.train.resume import resume_from, source_config
    from fsdpx.train.sources import build_source

    last = last_checkpoint(ckpt_dir)
    state, _ = resume_from(last)
    source = build_source(source_config(last))
    with torch.no_grad():
        out = functional_call(source.model.eval(), state.params, (x,))
    return out if isinstance(out, torch.Tensor) else out.logits


def hf_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    """The logits on ``x`` of ``AutoModelForCausalLM.from_pretrained(path)`` in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(x).logits


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(0))


def cli(args: list[str], nproc: int | None = None) -> subprocess.CompletedProcess:
    """``python -m fsdpx ARGS [--nproc N]`` in a subprocess of this checkout, one thread."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    extra = ["--nproc", str(nproc)] if nproc else []
    return subprocess.run([sys.executable, "-m", "fsdpx", *args, *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def cli_started(args: list[str], nproc: int | None = None) -> subprocess.Popen:
    """:func:`cli` started and not waited for (its output in pipes: wait with :func:`finished`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    extra = ["--nproc", str(nproc)] if nproc else []
    return subprocess.Popen([sys.executable, "-m", "fsdpx", *args, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    """What :func:`cli` returns, for a :func:`cli_started` process (killed if it is still running
    after ``timeout`` seconds, or if waiting fails)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def cli_side_by_side(*calls: tuple[list[str], int | None]) -> list[subprocess.CompletedProcess]:
    """:func:`cli` of each ``(args, nproc)``, all started at once (independent runs, e.g. the
    layouts compared with one process); their results in order."""
    procs = [cli_started(args, nproc) for args, nproc in calls]
    try:
        return [finished(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def train(tmp_path: Path, name: str, *args: str) -> list[str]:
    """``fsdpx train`` arguments of a small run ``name`` writing under ``tmp_path``."""
    return ["train", "--out", str(tmp_path / "runs"), "--name", name, "--ckpt-dir", str(tmp_path / name), *SMALL,
            *args]
