"""A trained model leaves fsdpx as a directory transformers loads unmodified (issue 29, item 2):
at the end of every run (``runs/NAME/model``) and from any checkpoint (``fsdpx export CKPT --to
OUT``), whatever layout wrote it. The built-in GPT has its own documented format
(``fsdpx.train.export.load_gpt``).

Tiny GPT-2 (tied head) and Llama models are created in ``tmp_path`` (nothing is downloaded) and
trained through the real CLI. The export must give transformers' ``from_pretrained`` the logits
of fsdpx's final parameters (read back from the run's last checkpoint by ``resume_from``, not by
the export's own reading), a run at lr 0 must export exactly the weights it loaded, and the
export of a checkpoint must be the end-of-run export's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdpx.cli import main
from support.finetune import cli, final_logits, hf_logits, last_checkpoint, saved, tensors, tiny, tokens, train

GPT_SMALL = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2"]


def assert_same_files(a: Path, b: Path) -> None:
    """Two exports hold the same files, the same tensors bit for bit."""
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def test_a_one_process_run_exports_what_transformers_loads_with_its_final_logits(tmp_path):
    """GPT-2 (tied head), private, 2 steps in one process: ``runs/NAME/model`` is a
    ``save_pretrained`` directory without a duplicated head, ``from_pretrained`` gives the final
    parameters' logits, and ``fsdpx export`` of the last checkpoint writes the same bytes."""
    model_path = saved(tiny("gpt2"), tmp_path / "start")
    main(train(tmp_path, "a", "--model", "transformers", "--model-path", str(model_path), "--steps", "2"))
    out = tmp_path / "runs" / "a" / "model"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    written = tensors(out)
    assert "lm_head.weight" not in written and "transformer.wte.weight" in written  # tied: stored once
    assert all(t.dtype == torch.float32 for t in written.values())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["use_cache"] is True
    x = tokens()
    assert torch.allclose(hf_logits(out, x), final_logits(tmp_path / "a", x), rtol=0, atol=1e-6)
    main(["export", str(tmp_path / "a"), "--to", str(tmp_path / "again")])
    assert_same_files(tmp_path / "again", out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_a_run_at_lr_0_exports_exactly_the_weights_it_loaded_and_trains_from_its_export(tmp_path):
    """Llama at lr 0, non-private: the export holds the saved tensors bit for bit; a run started
    from the export (``--model-path``, the round trip) exports them again, bit for bit."""
    model_path = saved(tiny("llama"), tmp_path / "start")
    lr0 = ["--model", "transformers", "--lr", "0", "--non-private", "--steps", "2"]
    main(train(tmp_path, "a", *lr0, "--model-path", str(model_path)))
    first = tmp_path / "runs" / "a" / "model"
    exported, original = tensors(first), tensors(model_path)
    assert sorted(exported) == sorted(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k
    main(train(tmp_path, "b", *lr0, "--model-path", str(first)))
    assert_same_files(tmp_path / "runs" / "b" / "model", first)


@pytest.mark.slow
def test_a_zero3_run_exports_its_final_parameters_and_its_checkpoint_exports_the_same(tmp_path):
    """``--strategy zero3 --nproc 2``: rank 0 writes the gathered parameters; transformers gets
    the final logits, and ``fsdpx export`` of the sharded checkpoint writes the same bytes."""
    model_path = saved(tiny("gpt2"), tmp_path / "start")
    done = cli(train(tmp_path, "z", "--model", "transformers", "--model-path", str(model_path), "--steps", "2",
                     "--strategy", "zero3"), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "runs" / "z" / "model"
    x = tokens()
    assert torch.allclose(hf_logits(out, x), final_logits(tmp_path / "z", x), rtol=0, atol=1e-6)
    main(["export", str(last_checkpoint(tmp_path / "z")), "--to", str(tmp_path / "from-ckpt")])
    assert_same_files(tmp_path / "from-ckpt", out)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_what_its_run_exported(tmp_path):
    """``--tp 2``: the checkpoint stores the attention and MLP weights cut across ranks; read
    whole, they make the same export as the run's own."""
    model_path = saved(tiny("llama"), tmp_path / "start")
    done = cli(train(tmp_path, "t", "--model", "transformers", "--model-path", str(model_path), "--steps", "2",
                     "--strategy", "zero2", "--tp", "2"), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    main(["export", str(tmp_path / "t"), "--to", str(tmp_path / "from-ckpt")])
    assert_same_files(tmp_path / "from-ckpt", tmp_path / "runs" / "t" / "model")


def test_the_built_in_gpt_exports_its_own_format(tmp_path):
    """The default model: ``model.safetensors`` + ``gpt_config.json``; ``load_gpt`` gives the
    final parameters' logits exactly; ``--no-export`` writes no model."""
    from fsdpx.train.export import load_gpt

    main(train(tmp_path, "g", *GPT_SMALL, "--steps", "2"))
    out = tmp_path / "runs" / "g" / "model"
    assert json.loads((out / "gpt_config.json").read_text())["format"] == "fsdpx-gpt"
    assert "lm_head.weight" not in tensors(out)  # tied to wte.weight
    x = tokens() % 60
    with torch.no_grad():
        assert torch.equal(load_gpt(out)(x), final_logits(tmp_path / "g", x))
    main(train(tmp_path, "n", *GPT_SMALL, "--steps", "1", "--no-export"))
    assert not (tmp_path / "runs" / "n" / "model").exists()


def test_export_refuses_an_existing_directory_and_a_path_that_is_no_checkpoint(tmp_path, capsys):
    """Exit 2, one line, nothing written: a non-empty ``--to`` (kept as it was), a path that
    is not a checkpoint. ``--overwrite`` replaces the directory."""
    main(train(tmp_path, "g", *GPT_SMALL, "--steps", "1", "--no-export"))
    capsys.readouterr()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for args in (["export", str(tmp_path / "g"), "--to", str(taken)],
                 ["export", str(tmp_path / "runs"), "--to", str(tmp_path / "new")]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("fsdpx export: error: "), err
    assert [p.name for p in taken.iterdir()] == ["notes.txt"] and not (tmp_path / "new").exists()
    main(["export", str(tmp_path / "g"), "--to", str(taken), "--overwrite"])
    assert sorted(p.name for p in taken.iterdir()) == ["gpt_config.json", "model.safetensors"]


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_an_export_that_fails_is_one_line_exit_1_and_keeps_the_metrics(tmp_path, monkeypatch, capsys, error):
    """A disk that fills up while the model is written (Python's error, or safetensors' own):
    exit 1, one line naming the directory and the cause; the run's metrics, plot and checkpoint
    are kept, no partial model is left."""
    from safetensors import SafetensorError

    from fsdpx.train import export

    def full(*args, **kwargs):
        if error == "OSError":
            raise OSError(28, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "_write_gpt", full)
    with pytest.raises(SystemExit) as exit_:
        main(train(tmp_path, "f", *GPT_SMALL, "--steps", "2"))
    assert exit_.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "not exported" in line]
    assert len(err) == 1 and "No space left on device" in err[0], err
    run_dir = tmp_path / "runs" / "f"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2 and (run_dir / "plot.png").is_file()
    assert last_checkpoint(tmp_path / "f").name == "step_2"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "config.toml", "metrics.jsonl", "plot.png"]
