"""Issue 29's "done when", as a user runs it: a tiny GPT-2 and a tiny Llama saved with
``save_pretrained`` in a temporary directory (nothing downloaded) are fine-tuned through the real
CLI in bf16 under ZeRO-3 on two processes with held-out evaluation, exported with ``fsdpx
export``, and loaded by transformers' ``from_pretrained``, whose logits equal those of fsdpx's
final (fp32 master) parameters within 1e-6; a run at ``--lr 0 --non-private`` exports exactly
the weights it loaded (``tests/test_export.py::
test_a_run_at_lr_0_exports_exactly_the_weights_it_loaded_and_trains_from_its_export``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from support.finetune import cli, final_logits, hf_logits, saved, tensors, tiny, tokens

HELD_OUT = "The notes held out are text the run never trains on, read the same way as its data.\n" * 40


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bf16_zero3_fine_tune_with_evaluation_exports_what_from_pretrained_loads(tmp_path, family):
    base = saved(tiny(family), tmp_path / "base")
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(HELD_OUT)
    run = cli(["train", "--out", str(tmp_path / "runs"), "--name", "ft", "--ckpt-dir", str(tmp_path / "ckpt"),
               "--model", "transformers", "--model-path", str(base), "--precision", "bf16", "--strategy", "zero3",
               "--eval-data", str(held_out), "--eval-every", "3", "--steps", "6", "--corpus-chars", "4000",
               "--block-size", "8", "--batch-size", "16", "--no-progress"], nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "ft" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if r.get("eval_loss") is not None]
    assert [r["step"] for r in evaluated] == [3, 6]  # every --eval-every steps (6 steps: 20 only took longer)
    assert all(math.isfinite(r["eval_loss"]) and r["eval_ppl"] > 1 for r in evaluated)
    assert json.loads((tmp_path / "runs" / "ft" / "config.json").read_text())["run"]["precision"] == "bf16"
    out = tmp_path / "exported"
    done = cli(["export", str(tmp_path / "ckpt"), "--to", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(t.dtype == torch.float32 for t in tensors(out).values())  # the fp32 masters, not bf16 copies
    x = tokens()
    assert torch.allclose(hf_logits(out, x), final_logits(tmp_path / "ckpt", x), rtol=0, atol=1e-6)
    moved = {k: float((v - tensors(base)[k]).abs().max()) for k, v in tensors(out).items() if k in tensors(base)}
    assert max(moved.values()) > 0  # it trained
