"""Held-out evaluation (issue 29, item 5): ``--eval-data PATH --eval-every N [--eval-batches K]``
writes ``eval_loss`` and ``eval_ppl`` into ``metrics.jsonl`` at every multiple of N and at the last
step, shows them in the progress bar and the summary and draws them in ``plot.png``, the same in
every layout, spending no privacy budget.

Every run goes through the real CLI on what a user brings: a text or ``.npy`` file beside the
built-in GPT, the embedded corpus, and a tiny GPT-2 saved with ``save_pretrained`` (its dropout
left on, as transformers' default). The eval loss is checked against the test's own computation:
the run's exported model (``runs/NAME/model``, loaded by ``load_gpt`` or transformers'
``from_pretrained``) on the windows the test cuts itself (rows ``i * N // n``, the documented
choice).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.threads import one_thread  # noqa: F401 - the fixture

from fsdpx.cli import main
from fsdpx.train import ConfigError, RunConfig
from fsdpx.train import data
from fsdpx.train.config import read_file
from fsdpx.train.export import load_gpt
from fsdpx.train.report import bar_text, plot

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
SMALL = ["--block-size", str(BLOCK), "--batch-size", "8", "--n-layer", "1", "--n-embd", "16", "--n-head", "2"]
WORDS = "the cat sat on a mat and the dog ran to the park while two birds sang".split()
REL = 1e-6
"""Sharded against one-process eval loss: the same parameters up to the layouts' float summation
order, evaluated by the same forward; measured within 1e-8 relative (4 steps, lr 1e-3)."""


def text(path: Path, words: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    return path


def train(tmp_path: Path, name: str, *args: str) -> list[str]:
    return ["train", "--out", str(tmp_path / "runs"), "--name", name, "--no-progress", *SMALL, *args]


def cli(args: list[str], nproc: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    extra = ["--nproc", str(nproc)] if nproc else []
    return subprocess.run([sys.executable, "-m", "fsdpx", *args, *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evaluated(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r}


def held_out_windows(ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own cut: non-overlapping windows of ``BLOCK + 1`` tokens, ``n`` of the ``N``
    evenly spaced (rows ``i * N // n``), inputs and next-token targets."""
    total = (len(ids) - 1) // BLOCK
    rows = [i * total // min(n, total) for i in range(min(n, total))]
    x = torch.tensor([ids[r * BLOCK: (r + 1) * BLOCK] for r in rows])
    y = torch.tensor([ids[r * BLOCK + 1: (r + 1) * BLOCK + 1] for r in rows])
    return x, y


def mean_token_loss(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), y.reshape(-1)))


def gpt_loss(export: Path, ids: list[int], n: int) -> float:
    model = load_gpt(export).eval()
    x, y = held_out_windows(ids, n)
    with torch.no_grad():
        return mean_token_loss(model(x), y)


# --------------------------------------------------------------------------- what a run records


@pytest.mark.parametrize("kind", ["text", "npy", "corpus"])
def test_eval_records_at_multiples_of_n_and_the_last_step_equal_the_exported_models_loss(tmp_path, kind, capsys):
    """Built-in GPT, private, 5 steps, ``--eval-every 2``: ``eval_loss`` and ``eval_ppl`` on steps
    2, 4 and 5 only, ``eval_ppl = exp(eval_loss)``; the last one equals the exported model's mean
    token loss on the 3 x 8 evenly spaced windows of the held-out file (of 40), as the test cuts
    them: a text file (bytes), a memory-mapped ``.npy`` of token ids, and a text file under the
    embedded corpus's character alphabet. The summary names it."""
    if kind == "text":
        train_file, held = text(tmp_path / "train.txt", 400, 0), text(tmp_path / "held.txt", 160, 1)
        ids = list(held.read_bytes())
        source = ["--data-path", str(train_file)]
    elif kind == "npy":
        rng = np.random.default_rng(0)
        np.save(tmp_path / "train.npy", rng.integers(0, 50, 2000).astype(np.uint16))
        ids = rng.integers(0, 50, 40 * BLOCK + 1).astype(np.uint16)
        np.save(tmp_path / "held.npy", ids)
        held, ids, source = tmp_path / "held.npy", ids.tolist(), ["--data-path", str(tmp_path / "train.npy")]
    else:
        held = tmp_path / "held.txt"
        held.write_text(data.corpus(40 * BLOCK + 1, seed=7))
        ids, source = data.encode(held.read_text()).tolist(), ["--corpus-chars", "3000"]
    main(train(tmp_path, "a", *source, "--eval-data", str(held), "--eval-every", "2", "--eval-batches", "3",
               "--steps", "5"))
    run_dir = tmp_path / "runs" / "a"
    records = metrics(run_dir)
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
    assert all(("eval_ppl" in r) == ("eval_loss" in r) for r in records)
    for r in records:
        if "eval_loss" in r:
            assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
            assert 0 <= r["eval_seconds"] <= r["step_seconds"]
    assert records[-1]["eval_loss"] == pytest.approx(gpt_loss(run_dir / "model", ids, 3 * 8), rel=1e-6)
    assert json.loads((run_dir / "config.json").read_text())["eval"]["eval_data"] == str(held)
    out = capsys.readouterr().out
    assert f"held-out     eval loss {records[-1]['eval_loss']:.3f} (perplexity" in out and "at step 5" in out


def tiny_gpt2(path: Path) -> Path:
    """A tiny GPT-2 over the 256 byte ids, dropout left at transformers' default (0.1): the
    training forward drops, the evaluation must not."""
    import transformers

    torch.manual_seed(3)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(path))
    return path


def hf_loss(export: Path, ids: list[int], n: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True)  # in eval mode
    x, y = held_out_windows(ids, n)
    with torch.no_grad():
        return mean_token_loss(model(x).logits, y)


@pytest.mark.parametrize("layout", [(), pytest.param(("--strategy", "zero3"), marks=pytest.mark.slow)],
                         ids=["one process", "zero3"])
def test_a_saved_transformers_model_is_evaluated_as_from_pretrained_computes(tmp_path, layout):
    """GPT-2 from ``save_pretrained``, bytes, 3 steps, ``--eval-every 2`` (one process, then ZeRO-3
    over 2 processes, whose ranks hold their blocks only): eval at steps 2 and 3, the last equal
    to transformers' own ``from_pretrained`` model of the run's export on the held-out windows
    (dropout off in evaluation: with it on, the two would differ by far more than 1e-5)."""
    model = tiny_gpt2(tmp_path / "gpt2")
    train_file, held = text(tmp_path / "train.txt", 400, 0), text(tmp_path / "held.txt", 160, 1)
    args = train(tmp_path, "hf", "--model", "transformers", "--model-path", str(model), "--data-path",
                 str(train_file), "--eval-data", str(held), "--eval-every", "2", "--eval-batches", "2", "--steps", "3",
                 *layout)
    done = cli(args, nproc=2 if layout else None)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "hf"
    losses = evaluated(run_dir)
    assert sorted(losses) == [2, 3]
    assert losses[3] == pytest.approx(hf_loss(run_dir / "model", list(held.read_bytes()), 2 * 8), rel=1e-5)


# --------------------------------------------------------------------------- every layout, one number


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    tmp = tmp_path_factory.mktemp("layouts")
    text(tmp / "train.txt", 400, 0), text(tmp / "held.txt", 160, 1)
    done = cli(layout_run(tmp, "one"))
    assert done.returncode == 0, done.stderr
    return tmp, evaluated(tmp / "runs" / "one")


def layout_run(tmp: Path, name: str, *layout: str) -> list[str]:
    return ["train", "--out", str(tmp / "runs"), "--name", name, "--no-progress", "--block-size", str(BLOCK),
            "--batch-size", "8", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--data-path",
            str(tmp / "train.txt"), "--eval-data", str(tmp / "held.txt"), "--eval-every", "2", "--steps", "4",
            "--non-private", "--lr", "1e-3", *layout]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--strategy", "zero3"), ("--strategy", "zero1", "--tp", "2"),
                                    ("--strategy", "ddp", "--pp", "2")], ids=["zero3", "tp", "pp"])
def test_every_layout_evaluates_what_one_process_evaluates(one_process, layout):
    """The same run (2 layers, 4 steps, eval at 2 and 4) over 2 processes as ZeRO-3, tensor
    parallel and a pipeline: the eval losses equal the one-process run's within ``REL``."""
    tmp, expected = one_process
    name = "-".join(layout).replace("--", "")
    done = cli(layout_run(tmp, name, *layout), nproc=2)
    assert done.returncode == 0, done.stderr
    got = evaluated(tmp / "runs" / name)
    assert sorted(got) == sorted(expected) == [2, 4]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=REL), step


# --------------------------------------------------------------------------- no budget, no side effect


def test_evaluation_spends_no_budget_and_changes_no_step(tmp_path):
    """A private run with ``--eval-every 1`` and the same run without evaluation: every step's
    epsilon, loss, batch and norms are the same bits (evaluation draws no random number, takes no
    gradient and asks the accountant nothing), and the summary's epsilon too."""
    train_file, held = text(tmp_path / "train.txt", 400, 0), text(tmp_path / "held.txt", 160, 1)
    main(train(tmp_path, "plain", "--data-path", str(train_file), "--steps", "4"))
    main(train(tmp_path, "eval", "--data-path", str(train_file), "--steps", "4", "--eval-data", str(held),
               "--eval-every", "1"))
    drop = ("step_seconds", "elapsed_seconds", "eval_loss", "eval_ppl", "eval_seconds")
    plain, with_eval = metrics(tmp_path / "runs" / "plain"), metrics(tmp_path / "runs" / "eval")
    assert all("eval_loss" in r for r in with_eval)
    assert [{k: v for k, v in r.items() if k not in drop} for r in with_eval] == \
        [{k: v for k, v in r.items() if k not in drop} for r in plain]
    assert with_eval[-1]["epsilon"] == plain[-1]["epsilon"] and math.isfinite(plain[-1]["epsilon"])


# --------------------------------------------------------------------------- the user's mistakes


def test_the_training_file_as_eval_data_is_named_in_a_warning_once(tmp_path, capsys):
    """``--eval-data`` naming the training file (by another spelling of its path) runs, with one
    warning on stderr naming both flags; a different file gets none."""
    train_file = text(tmp_path / "train.txt", 400, 0)
    other = tmp_path / "sub" / ".." / "train.txt"
    (tmp_path / "sub").mkdir()
    main(train(tmp_path, "same", "--non-private", "--data-path", str(train_file), "--eval-data", str(other),
               "--eval-every", "1", "--steps", "1"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--eval-data" in warnings[0] and "--data-path" in warnings[0]
    assert "is the training file" in warnings[0]
    held = text(tmp_path / "held.txt", 160, 1)
    main(train(tmp_path, "other", "--non-private", "--data-path", str(train_file), "--eval-data", str(held),
               "--eval-every", "1", "--steps", "1"))
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("args, named", [
    (["--eval-every", "2"], "--eval-every needs --eval-data"),
    (["--eval-data", "HELD"], "--eval-data needs --eval-every"),
    (["--eval-data", "HELD", "--eval-every", "0"], "--eval-every"),
    (["--eval-data", "MISSING", "--eval-every", "2"], "--eval-data"),
    (["--eval-data", "SHORT", "--eval-every", "2"], "--eval-data"),
    (["--eval-data", "HELD", "--eval-every", "2", "--eval-batches", "0"], "--eval-batches"),
], ids=["every without data", "data without every", "every 0", "missing file", "too short", "batches 0"])
def test_bad_eval_data_is_refused_before_anything_is_written(tmp_path, capsys, args, named):
    """Exit 2, the flag named in the error line, and no run directory."""
    train_file, held = text(tmp_path / "train.txt", 400, 0), text(tmp_path / "held.txt", 160, 1)
    (tmp_path / "short.txt").write_text("the cat")  # 7 bytes: no window of 16 + 1
    paths = {"HELD": str(held), "MISSING": str(tmp_path / "nope.txt"), "SHORT": str(tmp_path / "short.txt")}
    with pytest.raises(SystemExit) as stop:
        main(train(tmp_path, "bad", "--data-path", str(train_file), "--steps", "1",
                   *(paths.get(a, a) for a in args)))
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and named in err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_sharded_run_refuses_a_missing_eval_file_before_writing(tmp_path):
    """``--strategy zero3 --nproc 2`` with an eval file that does not exist: exit 2, one error
    line naming ``--eval-data``, no run directory."""
    train_file = text(tmp_path / "train.txt", 400, 0)
    done = cli(train(tmp_path, "bad", "--data-path", str(train_file), "--steps", "1", "--strategy", "zero3",
                     "--eval-data", str(tmp_path / "nope.txt"), "--eval-every", "1"), nproc=2)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--eval-data" in errors[0] and "does not exist" in errors[0], done.stderr
    assert not (tmp_path / "runs" / "bad").exists()


def test_the_config_file_holds_an_eval_section(tmp_path):
    """``[eval] data/every/batches/batch_size`` are the flags' settings; ``every`` without ``data``
    is refused as the flag is, and so is evaluation of ``model = "python"``."""
    (tmp_path / "run.toml").write_text('[eval]\ndata = "held.txt"\nevery = 5\nbatches = 2\nbatch_size = 4\n')
    config = RunConfig.of(**read_file(tmp_path / "run.toml"))
    assert (config.eval.eval_data, config.eval.eval_every, config.eval.eval_batches, config.eval.eval_batch_size) \
        == ("held.txt", 5, 2, 4)
    assert [s for s in range(1, 13) if config.eval.due(s, 12)] == [5, 10, 12]
    (tmp_path / "bad.toml").write_text("[eval]\nevery = 5\n")
    with pytest.raises(ConfigError, match="eval_every needs eval_data"):
        RunConfig.of(**read_file(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="drop eval_data"):  # your own data_fn has no file kind nor tokenizer
        RunConfig.of(model="python", model_fn="m:f", data_fn="m:g", loss_fn="m:h", eval_data="held.txt", eval_every=1)


# --------------------------------------------------------------------------- resume, progress, plot


def test_a_resumed_run_keeps_the_evaluation_schedule(tmp_path):
    """3 steps with a checkpoint every 2 and ``--eval-every 2`` (eval at 2 and 3, the last), then
    ``--resume --steps 6``: the whole run's records are evaluated at 2, 3, 4 and 6."""
    train_file, held = text(tmp_path / "train.txt", 400, 0), text(tmp_path / "held.txt", 160, 1)
    args = train(tmp_path, "r", "--non-private", "--data-path", str(train_file), "--eval-data", str(held),
                 "--eval-every", "2", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2")
    main([*args, "--steps", "3"])
    main([*args, "--steps", "6", "--resume"])
    assert sorted(evaluated(tmp_path / "runs" / "r")) == [2, 3, 4, 6]


def test_the_progress_bar_and_the_plot_show_the_held_out_loss(tmp_path):
    """The progress bar's words after an evaluated step name the latest eval loss and perplexity
    and keep naming it until the next; ``plot.png`` draws it (the same history without it draws
    another picture)."""
    history = [{"step": 1, "loss": 3.0, "epsilon": 1.0},
               {"step": 2, "loss": 2.5, "epsilon": 1.5, "eval_loss": 2.75, "eval_ppl": math.exp(2.75)},
               {"step": 3, "loss": 2.25, "epsilon": 2.0}]
    assert "eval" not in bar_text(history[:1])
    assert bar_text(history).endswith(f"eval loss 2.750 (perplexity {math.exp(2.75):.4g}) at step 2")
    plot(history, tmp_path / "with.png", title="t", delta=1e-5)
    plot([{k: v for k, v in r.items() if not k.startswith("eval")} for r in history], tmp_path / "without.png",
         title="t", delta=1e-5)
    assert (tmp_path / "with.png").read_bytes() != (tmp_path / "without.png").read_bytes()
