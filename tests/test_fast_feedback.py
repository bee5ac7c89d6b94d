"""Fast feedback and the user's words (issue 28, items 5 and 6).

``fsdpx train --help`` took 7.9 s and a bad flag was reported after ~5 s: the command line
imported torch, the privacy core and the runtime before it parsed its arguments. Now ``--help``
and argument errors import none of them. That is tested by the modules a real ``fsdpx`` process
imports (``python -X importtime``), not by a wall-clock bound, which a loaded machine would
break: torch alone takes several seconds to import, the command line without it ~0.2 s.

Errors name settings as the user gave them: the flag typed (``--data-path``), the config
file's key (``[data] path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpx.sharding import strategies
from fsdpx.sharding.schedule import KINDS
from fsdpx.train import cli
from fsdpx.train.layout import SCHEDULES, STRATEGIES
from fsdpx.train.wording import as_given

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy", "scipy", "transformers", "matplotlib", "tqdm", "dp_accounting", "privacy", "ckpt",
         "offload")
"""Top-level packages that take seconds to import (or pull those that do)."""


def imported_by(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime -m fsdpx <argv>`` on this checkout; returns the process and
    the top-level packages it imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "fsdpx", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    names = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
             if line.startswith("import time:")}
    return done, names


@pytest.mark.parametrize("argv, code, says", [
    (["train", "--help"], 0, "--data-path"),
    (["train", "--steps", "0"], 2, "--steps: must be an integer >= 1"),
    (["train", "--bogus"], 2, "unknown flag --bogus"),
    (["train", "--strategy", "zero4"], 2, "invalid choice: 'zero4'"),
    (["train", "--nproc", "2"], 2, "--nproc needs --strategy"),
    (["train", "--n-embd", "30", "--n-head", "4"], 2, "--n-embd=30 must be divisible by --n-head=4"),
    (["train", "--config", "missing.toml"], 2, "cannot read config file missing.toml"),
    (["jobs", "--help"], 0, "plan"),
    (["jobs", "plan", "--help"], 0, "--time-limit"),
    (["jobs", "run", "--help"], 0, "--retries"),
    (["jobs", "plan", "--devices", "x"], 2, "invalid int value"),
    (["schedule", "--help"], 0, "--microbatches"),
    (["schedule", "looped", "--ranks", "2", "--microbatches", "2"], 2, "invalid choice: 'looped'"),
    (["audit", "--help"], 0, "--noise-multiplier"),
    (["audit", "--noise-multiplier", "4", "--guesses", "0"], 2, "--guesses 0 must be in [1, --canaries 1000]"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_help_and_argument_errors_import_nothing_heavy(tmp_path, argv, code, says):
    done, names = imported_by(argv, tmp_path)
    assert done.returncode == code, done.stderr[-2000:]
    assert says in done.stdout + done.stderr
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def test_a_run_still_imports_what_it_needs(tmp_path):
    """The check above sees imports: a command that trains does import torch (one step). It
    does not import ``scipy.stats`` (0.5-2 s, before every rank's first step), which only an
    audit needs (``privacy.audit`` imports scipy where it uses it)."""
    done, names = imported_by(["train", "--steps", "1", "--n-layer", "1", "--n-embd", "8", "--n-head", "1",
                               "--corpus-chars", "4000", "--batch-size", "8", "--no-progress", "--non-private"],
                              tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"torch", "privacy"} <= names
    modules = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "privacy.audit.bound" in modules and "scipy.stats" not in modules


def test_the_light_names_are_the_algebras():
    """The parser's choices are plain tuples (the sharding package loads torch); they are the
    algebra's names."""
    assert STRATEGIES == tuple(sorted(strategies.ALL))
    assert SCHEDULES == KINDS


def test_the_built_in_techniques_load_on_first_use(tmp_path):
    """Importing ``fsdpx.jobs`` does not import torch; the registry's first use registers the
    built-ins, before a user's technique of a taken name is refused."""
    script = ("import sys\nimport fsdpx.jobs as jobs\nassert 'torch' not in sys.modules\n"
              "from fsdpx.jobs import techniques\nassert {'ddp', 'zero3'} <= set(techniques.names())\n"
              "try:\n    jobs.register('ddp', techniques.get('zero3'))\nexcept ValueError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "technique 'ddp' is already registered" in done.stdout


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--no-progress", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fsdpx train: error: ")
    return err.removeprefix("fsdpx train: error: ")


def _toml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_errors_name_the_flags_or_keys_the_user_gave(tmp_path, capsys):
    """Issue 28: errors named the config's field names (``data_path``, ``ckpt_dir``) where the
    user had typed flags. A value given by flag is named by its flag, one read from a config
    file by its key; a setting not given is named the way the user gives settings in that
    command."""
    out = ["--out", str(tmp_path / "runs")]
    assert _error(capsys, ["--data", "text", *out]) == "--data 'text' needs --data-path"
    assert _error(capsys, ["--config", _toml(tmp_path / "a.toml", "[data]\nkind = 'text'\n"), *out]) == \
        "[data] kind = 'text' needs [data] path"
    assert _error(capsys, ["--resume", *out]) == "--resume needs --ckpt-dir"
    assert _error(capsys, ["--config", _toml(tmp_path / "b.toml", "[checkpoints]\nresume = true\n"), *out]) == \
        "[checkpoints] resume needs [checkpoints] dir"
    missing = tmp_path / "missing.txt"
    assert _error(capsys, ["--data-path", str(missing), *out]) == f"--data-path {missing} does not exist"
    assert _error(capsys, ["--config", _toml(tmp_path / "c.toml", f"[data]\npath = '{missing}'\n"), *out]) == \
        f"[data] path {missing} does not exist"
    assert not (tmp_path / "runs").exists()


def test_only_what_names_a_setting_is_reworded():
    """Paths, dotted names and inline tables keep their words; a one-word setting that is also an
    English word is reworded only where it plainly is the setting."""
    spelling = {"data_path": "--data-path", "ckpt_dir": "--ckpt-dir", "vocab_size": "--vocab-size",
                "model_fields": "--model-fields", "model": "--model", "data": "--data", "tp": "--tp"}
    assert as_given("data_path runs/ckpt_dir/x.txt does not exist", spelling) == \
        "--data-path runs/ckpt_dir/x.txt does not exist"
    assert as_given("its config's (model_fields = {vocab_size = ...})", spelling) == \
        "its config's (--model-fields {vocab_size = ...})"
    english = "a transformers model needs one of the data"
    assert as_given(english, spelling) == english
    assert as_given("model = \"python\" needs data", spelling) == "--model \"python\" needs data"
    assert as_given("needs tp > 1, got tp=1", spelling) == "needs --tp > 1, got --tp=1"
    assert as_given("give ckpt_dir", {"ckpt_dir": "[checkpoints] dir"}) == "give [checkpoints] dir"
