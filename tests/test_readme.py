"""README.md as a newcomer reads it (issue 28, item 7): every snippet and command runs as printed.

The README is read as a newcomer reads it, top to bottom, from a clone of the repository:

* a ```` ```python ```` block runs in a fresh interpreter; a block whose first line is
  ``# <path>`` shows that file of the repository, so it must equal the file, and runs as
  ``python <path>``;
* a ```` ```toml ```` block whose first line is ``# <path>`` shows that file, or an excerpt of it:
  every key and value it shows is the file's;
* a ```` ```sh ```` block is commands (a ``\\`` continues a line; ``#`` starts a comment). Each
  command is one run of its own, from a fresh clone, unless the block's first line is a comment
  saying ``one after another``: then its commands run in order, in one clone (``cd DIR`` moves
  the rest of the block there). A command whose comment says ``refused`` must exit with status 2,
  any other with 0.

A clone is a temporary directory holding copies of ``examples/`` and ``docs/`` (what the
README's commands name), and the commands reach this checkout's code through ``fsdpx``,
``torchrun`` and ``python`` on ``PATH`` (``PYTHONPATH`` is the repository): nothing is written in
the repository (``test_the_repository_is_left_as_it_was``).

Time: the README's runs are minutes each (300 steps by default), more processes than CI's 2
cores, or a GPU. So, and only so, the test (``shortened``, ``CHECKED``, ``NOT_RUN``):

* shortens step counts: a ``fsdpx train`` without ``--steps`` gets ``--steps 2`` (unless it
  resumes, which keeps its run's steps); a given ``--steps N``, ``--ckpt-every N`` and a
  checkpoint ``step_N`` become ``N // 5`` (at least 1), so a sequence that resumes and branches
  keeps its shape;
* runs the commands of ``CHECKED`` through the real CLI up to the moment it would start
  training, profiling or launching processes (parsing, the config, the layout, the refusals of
  ``fsdpx/train/preflight.py``, the jobs file and its functions), and no further;
* runs none of ``NOT_RUN``, each named with its reason.

``python tests/test_readme.py`` prints every block and what the test does with it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLONE = ("examples", "docs")  # what the README's commands and snippets name, beside the code
TIME_LIMIT_S = 300  # a command or snippet takes < 40 s on a loaded 2-core CPU; the limit only catches a hang

# The README's commands (as printed, comment dropped) that the test does not run, and why.
NOT_RUN = {
    "make test": "it is the whole suite, this test among it",
    "fsdpx train --device cuda": "needs a GPU (CI has none; benchmarks/gpu_check.py runs it on one)",
    "torchrun --standalone --nproc-per-node 1 -m fsdpx train --device cuda --strategy zero3": "needs a GPU",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m fsdpx train "
    "--strategy zero3 --device cuda": "needs two machines with 8 GPUs each; its one-machine form runs",
    "fsdpx jobs plan examples/jobs.toml --devices 64 --simulate --fail medium@5 --drift large@2:1.5":
        "before profiling, the feasibility of 4 jobs x 14 techniques on 1-64 devices (techniques.check_feasible)"
        " alone takes 70 s of CPU; the same command on the file's 8 devices is checked, the planner on 64"
        " devices runs in --synthetic 16 --devices 64",
}

# Commands run only up to where training, profiling or the launch of processes would begin.
_MORE_CORES = "more processes than CI's 2 cores (the layout and refusals are checked as the launcher checks them)"
_ONE_FLAG = ("`fsdpx train` with one more flag, whose run is tested on its own (named); "
             "here the flag, its values and the refusals are checked")
_PROFILES = "profiles every job under every technique: minutes"
CHECKED = {
    "fsdpx train --non-private": _ONE_FLAG + ": tests/test_cli.py",
    "fsdpx train --strategy hsdp --nproc 4": _MORE_CORES,
    "fsdpx train --tp 2 --strategy zero3 --nproc 4": _MORE_CORES,
    "fsdpx train --tp 2 --sequence-parallel --strategy zero3 --nproc 4": _MORE_CORES,
    "fsdpx train --pp 2 --strategy zero3 --nproc 2 --schedule 1f1b --microbatches 4":
        "a 2-process pipeline run, as tests/test_cli.py runs it (and the 3-D one on 8)",
    "fsdpx train --pp 2 --tp 2 --strategy zero3 --nproc 8 --schedule 1f1b --microbatches 8": _MORE_CORES,
    "fsdpx train --ckpt-dir ck --ckpt-every 50": _ONE_FLAG + "; checkpoints run in the sequence of issue 15 below",
    "fsdpx train --ckpt-dir ck --resume-if-present": _ONE_FLAG + ": tests/test_train_elastic.py",
    "fsdpx train --name private --overwrite": _ONE_FLAG + ": tests/test_newcomer_refusals.py",
    "fsdpx train --offload zenflow": _ONE_FLAG + ": tests/test_cli.py",
    "fsdpx train --offload zenflow --offload-full-warm-up-rounds 20": _ONE_FLAG + ": tests/test_deepspeed_config.py",
    "fsdpx train --deepspeed-config examples/ds_zenflow.json": _ONE_FLAG + ": tests/test_deepspeed_config.py",
    "fsdpx train --noise-multiplier 1.0 --batch-size 256 --clip-norm 0.5 --epsilon-budget 4": _ONE_FLAG
        + ": tests/test_budget.py",
    "fsdpx train --freeze 'wte,wpe@0-100'": _ONE_FLAG + ": tests/test_train_freeze.py",
    "fsdpx train --strategy zero2 --nproc 2 --ckpt-dir ck --max-restarts 2": "a restarted 2-process run: "
        "tests/test_train_elastic.py",
    "fsdpx train --config examples/run.toml --strategy zero2 --nproc 2 --name tiny-gpt2-zero2":
        "a 2-process run of the file: tests/test_train_config.py",
    "fsdpx train --model transformers --model-path my-gpt2 --data-path docs/architecture.md --tokenizer bytes"
    " --block-size 64 --batch-size 64 --steps 10 --name ft-gpt2-zero3 --strategy zero3 --nproc 2"
    " --eval-data docs/performance.md --eval-every 5":
        "a 2-process fine-tune of a saved GPT-2 with evaluation: tests/test_eval.py::"
        "test_a_saved_transformers_model_is_evaluated_as_from_pretrained_computes[zero3]",
    "fsdpx jobs plan examples/jobs.toml": _PROFILES,
    "fsdpx jobs run examples/jobs_local.toml --devices 2 --techniques ddp ddp-private --profile-counts 1 2":
        _PROFILES + ", then trains 4 jobs",
    "fsdpx jobs plan examples/mylab.toml": _PROFILES + " (2 min 45 s on a loaded 2-core machine)",
}

# `make demo` is the set-up (a venv, pip install: what CI's environment already is), then one
# command of the Makefile: that command runs, shortened.
RECIPES = {"make demo": "demo"}

# The harness of the CHECKED commands: this checkout's CLI with the step that would start
# training, profiling or processes replaced by a line, each command in its own directory (argv:
# a JSON file of [[cwd, args], ...] and where to write [[exit status, output], ...]). One
# interpreter for them all: each would otherwise spend seconds importing torch.
_CHECK_ONLY = """
import contextlib, io, json, os, sys
import fsdpx.jobs.profile_store as profile_store
import fsdpx.train.cli as train_cli
from fsdpx.cli import main

def stop(what):
    def stopped(*args, **kwargs):
        print(f"checked: {what} would begin here")
        raise SystemExit(0)
    return stopped

train_cli.run = stop("training")
train_cli._launch = stop("the launch of the processes")
profile_store.profile_side_by_side = stop("profiling")
results = []
for cwd, args in json.load(open(sys.argv[1])):
    os.chdir(cwd)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(args)
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:
            print(repr(e))
            status = 1
    results.append((status, out.getvalue()))
json.dump(results, open(sys.argv[2], "w"))
"""

_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_FILE = re.compile(r"# ([\w./-]+\.(?:py|toml))\n")
SHELLS = ("sh", "bash", "console", "shell")


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int  # where the block starts in README.md, for messages

    @property
    def file(self) -> str | None:
        """The repository file the block shows (its first line ``# <path>``), or None."""
        m = _FILE.match(self.body)
        return m.group(1) if m else None

    @property
    def in_order(self) -> bool:
        """Whether the block's commands run one after another in one directory."""
        first = self.body.lstrip().splitlines()[0] if self.body.strip() else ""
        return first.startswith("#") and "one after another" in first


def blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown``, in order."""
    return [Block(m.group(1), m.group(2), markdown.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(markdown)]


def split_comment(line: str) -> tuple[str, str]:
    """``line`` as (command, comment): a ``#`` outside quotes after a blank starts the comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


def commands(body: str) -> list[tuple[str, str]]:
    """The (command, comment) pairs of a shell block: ``\\`` continues a line, a comment-only
    line adds to the comment before it, blank lines are skipped; a ``$ `` prompt is dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in body.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip() + " "
            continue
        pending = ""
        command, comment = split_comment(line.removeprefix("$ "))
        if command:
            out.append((" ".join(command.split()), comment))
        elif comment and out:
            out[-1] = (out[-1][0], out[-1][1] + " " + comment)
    return out


def shortened(command: str) -> str:
    """``command`` with its step counts shortened (the module doc); other commands unchanged."""
    if "fsdpx train" not in command or "--help" in command:
        return command
    short = re.sub(r"(--steps|--ckpt-every) (\d+)", lambda m: f"{m.group(1)} {max(1, int(m.group(2)) // 5)}", command)
    short = re.sub(r"\bstep_(\d+)\b", lambda m: f"step_{max(1, int(m.group(1)) // 5)}", short)
    resumes = re.search(r"--resume(-from)?( |$)", command)
    return short if "--steps" in short or resumes else short + " --steps 2"


def demo_command() -> str:
    """The ``fsdpx`` command of the Makefile's ``demo`` recipe (after the set-up)."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    lines = [split_comment(line.strip())[0] for line in recipe.group(1).splitlines()]
    (line,) = [x for x in lines if "fsdpx " in x]
    return line.replace("$(BIN)/", "")


README_BLOCKS = blocks(README.read_text())
PYTHON = [b for b in README_BLOCKS if b.lang == "python"]
TOML = [b for b in README_BLOCKS if b.lang == "toml"]
SHELL = [b for b in README_BLOCKS if b.lang in SHELLS]
ALONE = [(b, c, note) for b in SHELL if not b.in_order for c, note in commands(b.body)]
IN_ORDER = [b for b in SHELL if b.in_order]
SLOW_COMMANDS = ("--nproc", "torchrun", "make demo")  # more than one process


def _id(command: str) -> str:
    return re.sub(r"[^\w.=@,-]+", "_", command)[:60]


@pytest.fixture(scope="module")
def path_bin(tmp_path_factory) -> Path:
    """A directory of ``fsdpx``, ``torchrun`` and ``python``: this checkout's, as installed."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, args in (("fsdpx", "-m fsdpx"), ("torchrun", "-m torch.distributed.run"), ("python", "")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        script.chmod(0o755)
    return bin_dir


def environment(path_bin: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{path_bin}{os.pathsep}{os.environ['PATH']}", "MPLBACKEND": "Agg",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def clone(where: Path) -> Path:
    """A directory holding what a clone of the repository holds beside the code."""
    where.mkdir(parents=True, exist_ok=True)
    for name in CLONE:
        shutil.copytree(ROOT / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))
    return where


def run(argv: list[str] | str, cwd: Path, env: dict[str, str], what: str) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIME_LIMIT_S,
                          shell=isinstance(argv, str), executable="/bin/bash" if isinstance(argv, str) else None)
    done.seconds = time.perf_counter() - start
    done.what = what
    return done


def report(done: subprocess.CompletedProcess) -> str:
    return (f"{done.what}: exit {done.returncode} after {done.seconds:.1f} s\n--- stdout\n{done.stdout[-3000:]}\n"
            f"--- stderr\n{done.stderr[-6000:]}")


def check(commands: list[tuple[str, Path]], env: dict[str, str], where: Path) -> list[tuple[int, str]]:
    """Run the CHECKED ``commands`` (each with its directory) in one interpreter; each one's
    (exit status, output)."""
    todo, done = where / "checks.json", where / "checked.json"
    argvs = []
    for command, cwd in commands:
        argv = shlex.split(command)
        assert argv[0] == "fsdpx", command
        argvs.append((str(cwd), argv[1:]))
    todo.write_text(json.dumps(argvs))
    ran = run([sys.executable, "-c", _CHECK_ONLY, str(todo), str(done)], where, env, "the checked commands")
    assert ran.returncode == 0, report(ran)
    return [tuple(r) for r in json.loads(done.read_text())]


def assert_checked(command: str, result: tuple[int, str]) -> None:
    status, output = result
    assert status == 0 and "checked: " in output, f"checked: {command}: exit {status}\n{output[-6000:]}"


def port_in_use(command: str) -> bool:
    """Whether a ``localhost:PORT`` the command names is taken (by another run on this machine)."""
    m = re.search(r"localhost:(\d+)", command)
    if not m:
        return False
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", int(m.group(1)))) == 0


def run_command(command: str, comment: str, cwd: Path, env: dict[str, str]) -> None:
    """Run one README command in ``cwd`` as the module doc says; assert its exit status."""
    if command in NOT_RUN:
        return
    if command in RECIPES:
        command = demo_command()
    if command in CHECKED:
        assert_checked(command, check([(command, cwd)], env, cwd.parent)[0])
        return
    short = shortened(command)
    done = run(short, cwd, env, short)
    if "refused" in comment:  # refused by fsdpx in one line, not by the shell (also status 2)
        assert done.returncode == 2 and re.search(r"^fsdpx[\w ]*: error: ", done.stderr, re.MULTILINE), report(done)
    else:
        assert done.returncode == 0, report(done)


# ------------------------------------------------------------------ the README's shape and this test's tables


def test_the_readme_opens_with_its_title_a_line_and_the_two_commands():
    text = README.read_text()
    title, blank, what, blank_too, fence = text.splitlines()[:5]
    assert (title, blank, blank_too, fence) == ("# fsdpx", "", "", "```sh"), text[:300]
    assert what and not what.startswith(("#", "`")), what
    assert [c for c, _ in commands(SHELL[0].body)] == ["make demo", "make test"]
    assert SHELL[0].line == 5


def test_every_block_is_one_the_test_reads():
    """A bare ```` ``` ```` or another language would escape the test: each block is python, toml
    or a shell."""
    assert {b.lang for b in README_BLOCKS} <= {"python", "toml", *SHELLS}, [(b.line, b.lang) for b in README_BLOCKS]
    assert PYTHON and TOML and SHELL


def test_every_command_not_run_or_only_checked_is_in_the_readme():
    printed = {c for b in SHELL for c, _ in commands(b.body)}
    for table in (NOT_RUN, CHECKED, RECIPES):
        assert set(table) <= printed, sorted(set(table) - printed)


def test_extraction_and_shortening():
    md = "x\n```sh\nfsdpx train --a 'b # c' \\\n    --d  # e\n# f\n\nmake demo\n```\n```python\na = 1\n```\n"
    got = blocks(md)
    assert [(b.lang, b.line) for b in got] == [("sh", 2), ("python", 9)]
    assert commands(got[0].body) == [("fsdpx train --a 'b # c' --d", "e f"), ("make demo", "")]
    assert shortened("fsdpx train --strategy zero3") == "fsdpx train --strategy zero3 --steps 2"
    assert shortened("fsdpx train --steps 20 --ckpt-dir ck --ckpt-every 5") == \
        "fsdpx train --steps 4 --ckpt-dir ck --ckpt-every 1"
    assert shortened("fsdpx train --resume-from ck/step_25 --lr 0.001") == "fsdpx train --resume-from ck/step_5 --lr 0.001"
    assert shortened("fsdpx schedule 1f1b --ranks 4") == "fsdpx schedule 1f1b --ranks 4"
    assert demo_command().startswith("fsdpx train ")


# ------------------------------------------------------------------------------------ files shown


@pytest.mark.parametrize("block", [b for b in PYTHON + TOML if b.file], ids=lambda b: b.file)
def test_a_file_shown_is_the_repositorys(block):
    path = ROOT / block.file
    assert path.is_file(), f"README.md line {block.line} shows {block.file}, which the repository lacks"
    if block.lang == "python":
        assert block.body == path.read_text(), f"README.md line {block.line} differs from {block.file}"
        return
    shown, whole = tomllib.loads(block.body), tomllib.loads(path.read_text())
    assert contained(shown, whole), f"README.md line {block.line} shows what {block.file} does not hold"


def contained(part, whole) -> bool:
    """Whether every key and value of ``part`` is in ``whole`` (tables by key, arrays of tables
    by element: each of ``part``'s is one of ``whole``'s)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contained(v, whole[k]) for k, v in part.items())
    if isinstance(part, list) and part and all(isinstance(x, dict) for x in part):
        return isinstance(whole, list) and all(any(contained(x, y) for y in whole) for x in part)
    return part == whole


# ------------------------------------------------------------------------------------ snippets


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"line{b.line}")
def test_python_snippet_runs(block, path_bin, tmp_path):
    here = clone(tmp_path / "clone")
    if block.file:
        argv = [sys.executable, block.file]
    else:
        script = tmp_path / f"readme_line{block.line}.py"
        script.write_text(block.body)
        argv = [sys.executable, str(script)]
    done = run(argv, here, environment(path_bin), f"README.md line {block.line}")
    assert done.returncode == 0, report(done)


# ------------------------------------------------------------------------------------ commands


def _marks(command: str):
    return [pytest.mark.slow] if any(s in command for s in SLOW_COMMANDS) else []


ALONE_CHECKED = [c for _, c, _ in ALONE if c in CHECKED]


@pytest.fixture(scope="module")
def checked(path_bin, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every CHECKED command of the blocks of separate runs, each from a fresh clone."""
    where = tmp_path_factory.mktemp("checked")
    cwds = [clone(where / f"clone{i}") for i in range(len(ALONE_CHECKED))]
    return dict(zip(ALONE_CHECKED, check(list(zip(ALONE_CHECKED, cwds)), environment(path_bin), where)))


@pytest.mark.parametrize("block,command,comment", [
    pytest.param(b, c, note, id=f"line{b.line}-{_id(c)}") for b, c, note in ALONE if c in CHECKED])
def test_command_is_accepted(block, command, comment, checked):
    """Checked only (``CHECKED`` says why): accepted up to where its work would begin."""
    assert_checked(command, checked[command])


@pytest.mark.parametrize("block,command,comment", [
    pytest.param(b, c, note, marks=_marks(c), id=f"line{b.line}-{_id(c)}") for b, c, note in ALONE
    if c not in CHECKED])
def test_command_runs(block, command, comment, path_bin, tmp_path):
    if command in NOT_RUN:
        pytest.skip(f"not run: {NOT_RUN[command]}")
    if port_in_use(command):
        pytest.skip(f"the port it names is taken on this machine: {command}")
    run_command(command, comment, clone(tmp_path / "clone"), environment(path_bin))


@pytest.mark.slow
@pytest.mark.parametrize("block", IN_ORDER, ids=lambda b: f"line{b.line}")
def test_commands_run_one_after_another(block, path_bin, tmp_path):
    here = clone(tmp_path / "clone")
    env = environment(path_bin)
    for command, comment in commands(block.body):
        if command.startswith("cd "):
            here = here / command.removeprefix("cd ").strip()
            assert here.is_dir(), f"README.md line {block.line}: {command}: no such directory"
            continue
        run_command(command, comment, here, env)


# ------------------------------------------------------------------------------------ nothing left behind


_BEFORE: set[str] = set()


def _repository_files() -> set[str]:
    """The repository's files git does not know (ignored ones included) outside caches."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")
            and not re.search(r"(__pycache__|\.pytest_cache|\.hypothesis|\.venv|\.egg-info)", line)}


def setup_module():
    _BEFORE.update(_repository_files())


def test_the_repository_is_left_as_it_was():
    """Runs last in this module (pytest keeps the file's order): the commands wrote in their clones only."""
    assert _repository_files() <= _BEFORE, sorted(_repository_files() - _BEFORE)


if __name__ == "__main__":
    for b in README_BLOCKS:
        print(f"--- README.md line {b.line}: {b.lang}" + (f", the file {b.file}" if b.file else "")
              + (", one after another" if b.in_order else ""))
        if b.lang in SHELLS:
            for c, _ in commands(b.body):
                doing = ("not run: " + NOT_RUN[c] if c in NOT_RUN else "checked only: " + CHECKED[c] if c in CHECKED
                         else f"runs: {shortened(demo_command() if c in RECIPES else c)}")
                print(f"{c}\n    {doing}")
