"""Issue 28, item 1: refuse before writing. Each defect a new user found, driven through the
real command line (a subprocess, as a user types it, from the directory holding ``runs/``):
the exit status (2), the one line on stderr (no traceback), and every file and directory under
the workspace unchanged, bytes and times. A sharded run (``--strategy zero2 --nproc 2``)
refuses in the launcher, before torchrun starts, with the same line.

The workspace is built once per module (a tiny non-private run ``runs/np``, a run
``runs/private`` as ``make demo``'s, and another run's checkpoints ``other_ck/step_{3,6,9}``)
and copied, times kept, for each test."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import ckpt
from fsdpx.train import RunConfig, cli, run
from fsdpx.train.preflight import (CheckpointDirInUseError, DirectoryUnusableError, NothingToResumeError,
                                   RunDirExistsError, check_directory)
from fsdpx.train.segments import read_record
from support.threads import one_thread  # noqa: F401 - autouse fixture

REPO = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000",
        "--batch-size", "16", "--steps", "2", "--no-progress"]
SHARDED = ["--strategy", "zero2", "--nproc", "2"]
PREFIX = "fsdpx train: error: "




def _in(directory: Path, argv: list[str]) -> None:
    """``fsdpx train ARGV`` in this process, from ``directory`` (relative paths, as a user's)."""
    here = os.getcwd()
    os.chdir(directory)
    try:
        cli.main(["train", *TINY, *argv])
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("newcomer")
    _in(ws, ["--non-private", "--steps", "3", "--name", "np"])
    _in(ws, ["--steps", "3"])  # runs/private, the directory `make demo` used to write
    _in(ws, ["--non-private", "--steps", "9", "--ckpt-every", "3", "--name", "other", "--ckpt-dir", "other_ck"])
    (ws / "some_file.txt").write_text("a user's file\n")
    (ws / "empty_ck").mkdir()
    return ws


@pytest.fixture
def ws(template, tmp_path) -> Path:
    """A fresh copy of the workspace, modification times kept."""
    copy = tmp_path / "ws"
    shutil.copytree(template, copy, symlinks=True)
    return copy


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: kind, size, modification time (ns) and, for files, the bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns,
                                         p.read_bytes() if p.is_file() else None)
    st = root.stat()
    out["."] = (True, st.st_size, st.st_mtime_ns, None)
    return out


class User(NamedTuple):
    """How to run a command as another user: a command prefix and what its environment adds."""

    prefix: list[str]
    env: dict[str, str]


def fsdpx_train(ws: Path, *argv: str, user: User | None = None) -> tuple[int, str, str]:
    """``fsdpx train ARGV`` from ``ws``: its exit status, stderr and stdout. In this process
    (``fsdpx.cli.main``, catching its exit) unless sharded or run as another ``user``: then as a
    subprocess, the launcher and its torchrun included."""
    if user is None and "--strategy" not in argv:
        return _in_process(ws, argv)
    user = user or User([], {})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": "1", **user.env}
    cmd = [*user.prefix, sys.executable, "-m", "fsdpx", "train", *TINY, *argv]
    done = subprocess.run(cmd, cwd=ws, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr, done.stdout


def _in_process(ws: Path, argv: tuple[str, ...]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            from fsdpx.cli import main

            here = os.getcwd()
            os.chdir(ws)
            try:
                main(["train", *TINY, *argv])
            finally:
                os.chdir(here)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue(), out.getvalue()


def assert_refused(ws: Path, line: str, *argv: str, user: User | None = None) -> None:
    """``fsdpx train ARGV`` exits 2 with exactly ``fsdpx train: error: LINE`` on stderr, nothing on
    stdout, and leaves every byte and time under ``ws`` as it was."""
    before = snapshot(ws)
    code, err, out = fsdpx_train(ws, *argv, user=user)
    assert (code, err.splitlines(), out) == (2, [PREFIX + line], ""), err
    assert snapshot(ws) == before


ONE_AND_SHARDED = [pytest.param(False, id="1-process"), pytest.param(True, id="zero2x2", marks=pytest.mark.slow)]
"""Every refusal once in one process and once sharded: the same line, the same exit status."""


# --------------------------------------------------------------------------- the defects


@pytest.mark.parametrize("sharded", ONE_AND_SHARDED)
def test_a_checkpoint_dir_that_is_a_file_is_refused_and_the_run_dir_kept(ws, sharded):
    """Defect: ``--ckpt-dir some_file.txt`` raised FileExistsError (exit 1; sharded: 62 lines of
    tracebacks) after cutting ``runs/np/metrics.jsonl`` from 3 lines to 0."""
    assert len((ws / "runs/np/metrics.jsonl").read_text().splitlines()) == 3
    flags = ["--non-private", "--name", "np", *(SHARDED if sharded else [])]
    assert_refused(ws, "--ckpt-dir some_file.txt is a file, not a directory", *flags, "--ckpt-dir", "some_file.txt")
    assert_refused(ws, "--ckpt-dir some_file.txt/ck: some_file.txt is a file, not a directory", *flags,
                   "--ckpt-dir", "some_file.txt/ck")
    assert len((ws / "runs/np/metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("sharded", ONE_AND_SHARDED)
def test_a_new_run_into_another_run_s_checkpoints_is_refused(ws, sharded):
    """Defect: a fresh run into a directory holding another run's step_3, step_6, step_9 mixed
    its checkpoints with them (exit 0, a RuntimeWarning), and the next --resume continued the
    other run's step 9."""
    assert_refused(ws, "--ckpt-dir other_ck already holds step_3, step_6, step_9: a new run there would mix its"
                       " checkpoints with another run's; continue that run with --resume, or give another --ckpt-dir",
                   "--non-private", "--name", "fresh", "--ckpt-dir", "other_ck", *(SHARDED if sharded else []))
    assert not (ws / "runs/fresh").exists()


@pytest.mark.parametrize("sharded", ONE_AND_SHARDED)
def test_an_existing_run_directory_is_refused_without_overwrite(ws, sharded):
    """Defect: after ``make demo``, ``fsdpx train --steps 3`` replaced ``runs/private`` (metrics
    300 lines -> 3, the plot replaced)."""
    plot = (ws / "runs/private/plot.png").read_bytes()
    assert_refused(ws, "--name private: runs/private already holds a run (config.json, config.toml, metrics.jsonl,"
                       " model, ...); pass --overwrite to replace it, --resume to continue it, or give another"
                       " --name", "--steps", "3", *(SHARDED if sharded else []))
    assert (ws / "runs/private/plot.png").read_bytes() == plot


@pytest.mark.parametrize("sharded", ONE_AND_SHARDED)
def test_resume_with_nothing_to_resume_is_an_error(ws, sharded):
    """Defect: ``--resume`` with a mistyped or empty ``--ckpt-dir`` printed "no checkpoint ...;
    starting at step 0" and exited 0: a typo silently restarted training."""
    tail = (", so there is nothing to resume; check the path, or start a new run without --resume"
            " (--resume-if-present resumes when there is a checkpoint and starts otherwise)")
    flags = ["--non-private", "--name", "np", *(SHARDED if sharded else []), "--resume"]
    assert_refused(ws, f"--resume: --ckpt-dir other_ckk does not exist{tail}", *flags, "--ckpt-dir", "other_ckk")
    assert_refused(ws, f"--resume: --ckpt-dir empty_ck is empty{tail}", *flags, "--ckpt-dir", "empty_ck")


def _as_another_user(ws: Path, cache: Path) -> User:
    """Run as a user that chmod binds: ourselves when this is not root; nobody (``setpriv``)
    when root, with ``cache`` for numba's compiled kernels; skips when nobody cannot run this
    Python and this repository (a home directory closed to others, say)."""
    if os.geteuid() != 0:
        return User([], {})
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, and setpriv is missing: cannot drop root's power to ignore chmod")
    nobody = User(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], {"NUMBA_CACHE_DIR": str(cache)})
    probe = subprocess.run([*nobody.prefix, sys.executable, "-c", "import fsdpx.train.cli"], cwd=ws,
                           capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO), **nobody.env}, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"running as root, and nobody (uid 65534) cannot run {sys.executable} with {REPO}"
                    f" ({probe.stderr.decode(errors='replace').strip().splitlines()[-1:]}): root ignores chmod")
    return nobody


@pytest.fixture
def open_dirs():
    """A workspace and a numba cache anyone may enter (pytest's tmp directories are closed to
    other users), removed after the test."""
    top = Path(tempfile.mkdtemp(prefix="fsdpx-newcomer-"))
    top.chmod(0o755)
    dirs = top / "ws", top / "numba"
    for d in dirs:
        d.mkdir()
        d.chmod(0o777)
    yield dirs
    for d in [top, *top.rglob("*")]:
        if d.is_dir() and not d.is_symlink():
            d.chmod(0o755)
    shutil.rmtree(top)


@pytest.mark.slow  # each command starts Python afresh as another user
@pytest.mark.parametrize("sharded", [False, True], ids=["1-process", "zero2x2"])
def test_an_unwritable_checkpoint_dir_is_refused(open_dirs, sharded):
    """Defect: an unwritable ``--ckpt-dir`` raised a PermissionError traceback. Run as a user
    chmod binds (root ignores it); ``test_an_unusable_directory_is_refused`` checks the same
    messages in this process."""
    ws, cache = open_dirs
    user = _as_another_user(ws, cache)
    (ws / "ro").mkdir()
    (ws / "ro").chmod(0o555)
    flags = ["--non-private", *(SHARDED if sharded else [])]
    assert_refused(ws, "--ckpt-dir ro is not writable (permission denied)", *flags, "--ckpt-dir", "ro", user=user)
    assert_refused(ws, "--ckpt-dir ro/ck cannot be created: ro is not writable (permission denied)", *flags,
                   "--ckpt-dir", "ro/ck", user=user)


def test_an_unusable_directory_is_refused(tmp_path, monkeypatch):
    """The checks of :func:`check_directory` without a second user: what ``os.access`` denies."""
    (tmp_path / "file").write_text("")
    with pytest.raises(DirectoryUnusableError, match="^--out x is a file, not a directory$"):
        check_directory(tmp_path / "file", "--out x")
    check_directory(tmp_path / "new" / "deeper", "--ckpt-dir new/deeper")  # created later, under tmp_path
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(DirectoryUnusableError, match=r"cannot be created: .* is not writable \(permission denied\)"):
        check_directory(tmp_path / "new", "--ckpt-dir new")
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.R_OK)
    with pytest.raises(DirectoryUnusableError, match=r"^--ckpt-dir t is not readable \(permission denied\)$"):
        check_directory(tmp_path, "--ckpt-dir t")


# --------------------------------------------------------------------------- the explicit modes


def test_overwrite_replaces_the_run_directory_and_resume_continues_into_its_own(ws, tmp_path):
    """``--overwrite`` is how a run replaces an existing run directory; ``--resume`` continues
    into the directory its checkpoints record, and is refused another run's."""
    _in(ws, ["--non-private", "--name", "np", "--overwrite", "--steps", "2"])
    assert len((ws / "runs/np/metrics.jsonl").read_text().splitlines()) == 2
    flags = ["--non-private", "--name", "a", "--ckpt-dir", "ck", "--ckpt-every", "2"]
    _in(tmp_path, [*flags, "--steps", "2"])
    _in(tmp_path, [*flags, "--steps", "4", "--resume"])
    assert len((tmp_path / "runs/a/metrics.jsonl").read_text().splitlines()) == 4
    (tmp_path / "runs/b").mkdir()
    (tmp_path / "runs/b/notes.txt").write_text("another run's")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as done:
        _in(tmp_path, ["--non-private", "--name", "b", "--ckpt-dir", "ck", "--steps", "6", "--resume"])
    assert done.value.code == 2 and snapshot(tmp_path) == before


def test_resume_if_present_starts_then_continues(tmp_path, capsys):
    """The explicit lenient mode (schedulers, elastic restarts): a new run when the directory
    holds no checkpoint (it may not exist yet, and the run directory may), a resume otherwise."""
    (tmp_path / "runs" / "job").mkdir(parents=True)
    (tmp_path / "runs" / "job" / "run_config.json").write_text("{}")  # as fsdpx jobs writes before the run
    flags = ["--non-private", "--name", "job", "--ckpt-dir", "ck", "--ckpt-every", "2", "--resume-if-present"]
    _in(tmp_path, [*flags, "--steps", "2"])
    assert "no checkpoint in ck yet (--resume-if-present); starting at step 0" in capsys.readouterr().err
    _in(tmp_path, [*flags, "--steps", "4"])
    assert "resuming at step 2" in capsys.readouterr().err
    rows = (tmp_path / "runs/job/metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]


def test_retention_deletes_only_this_run_s_checkpoints(tmp_path):
    """Defect: retention deleted a user's folder ``step_1/important.txt`` inside a ``--ckpt-dir``.
    Now it deletes only checkpoints whose manifest records this run's id (kept in ``run.json``
    across segments)."""
    flags = ["--non-private", "--name", "a", "--ckpt-dir", "ck", "--ckpt-every", "2"]
    _in(tmp_path, [*flags, "--steps", "2"])
    (tmp_path / "ck" / "step_1").mkdir()
    (tmp_path / "ck" / "step_1" / "important.txt").write_text("mine")
    _in(tmp_path, [*flags, "--steps", "10", "--resume"])
    root = tmp_path / "ck"
    assert ckpt.CheckpointManager(root).steps() == [1, 6, 8, 10]
    assert (root / "step_1" / "important.txt").read_text() == "mine"
    run_id = read_record(root)["run_id"]
    assert {ckpt.read_manifest(root / f"step_{s}").run_id for s in (6, 8, 10)} == {run_id}


def test_the_python_entry_refuses_before_writing(ws, monkeypatch):
    """``fsdpx.train.run(config)`` raises the same named ConfigError subclasses, before writing."""
    monkeypatch.chdir(ws)
    tiny = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, corpus_chars=4000, batch_size=16.0, steps=2,
                private=False)
    before = snapshot(ws)
    cases = [(DirectoryUnusableError, dict(name="np", ckpt_dir="some_file.txt")),
             (CheckpointDirInUseError, dict(name="fresh", ckpt_dir="other_ck")),
             (RunDirExistsError, dict(name="np")),
             (NothingToResumeError, dict(name="np", ckpt_dir="empty_ck", resume=True))]
    for error, values in cases:
        with pytest.raises(error):
            run(RunConfig.of(**tiny, **values), progress=False)
    assert snapshot(ws) == before
