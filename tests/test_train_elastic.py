"""Elastic restarts (issue 14): ``fsdpx train --max-restarts N`` survives a worker killed at a
random step, twice, and ends with the same bits as a run never interrupted: every step is logged
once with the same loss and epsilon, and the final checkpoints hold equal tensors."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckpt
from fsdpx.sharding import Mesh
from fsdpx.train.config import RunConfig
from fsdpx.train.launch import LAUNCHER_PID
from fsdpx.train.resume import restarted_config

STEPS = 14
ARGS = ["--strategy", "zero2", "--nproc", "2", "--steps", str(STEPS), "--n-layer", "1", "--n-embd", "8",
        "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000", "--batch-size", "16",
        "--noise-multiplier", "1", "--ckpt-every", "2", "--no-progress"]


def test_a_first_attempt_runs_as_configured_and_a_restart_resumes(tmp_path):
    config = RunConfig.of(ckpt_dir=str(tmp_path / "ck"))
    assert restarted_config(config, 0) is config
    restarted = restarted_config(config, 1).checkpoints  # resumes if the failed attempt saved, else starts
    assert restarted.resume_if_present and not restarted.resume and restarted.resume_from is None
    branch = RunConfig.of(resume_from=str(tmp_path / "source"), name="b", out=str(tmp_path))
    # its own root holds nothing yet: branch again, into the run directory its first attempt wrote
    assert restarted_config(branch, 2) == branch.replace(overwrite=True)


def test_max_restarts_needs_a_strategy_and_a_checkpoint_dir(capsys):
    from fsdpx.cli import main

    for argv in (["train", "--max-restarts", "2", "--ckpt-dir", "ck"], ["train", "--max-restarts", "2",
                                                                         "--strategy", "ddp"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
        assert "--max-restarts needs --strategy" in capsys.readouterr().err


def _workers(launcher: int) -> set[int]:
    """The torchrun workers of ``launcher`` (its environment, and a LOCAL_RANK torchrun set)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"{LAUNCHER_PID}={launcher}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
                found.add(int(entry.name))
    return found


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def _final_tensors(root: Path) -> dict[str, torch.Tensor]:
    newest = ckpt.CheckpointManager(root).latest()
    state = ckpt.load(newest, mesh=Mesh(dp=1), strategy=None, private=True)
    leaves = {"params/" + k: v for k, v in state.params.items()}
    return leaves


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_run_whose_worker_is_killed_twice_ends_where_an_uninterrupted_run_ends(tmp_path):
    # the uninterrupted run, side by side with the restarted one (waited for at the end)
    straight = subprocess.Popen([sys.executable, "-m", "fsdpx", "train", *ARGS, "--out", str(tmp_path / "a"),
                                 "--ckpt-dir", str(tmp_path / "a_ck")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    rng = random.Random(int(os.environ.get("PYTEST_SEED", "14")))
    kills = sorted(rng.sample(range(3, STEPS - 2), 2))
    out, root = tmp_path / "b", tmp_path / "b_ck"
    launcher = subprocess.Popen([sys.executable, "-m", "fsdpx", "train", *ARGS, "--max-restarts", "2", "--out",
                                 str(out), "--ckpt-dir", str(root)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    metrics = out / "private" / "metrics.jsonl"
    killed: set[int] = set()
    try:
        for at in kills:
            deadline = time.monotonic() + 240
            while _last_step(metrics) < at or not (_workers(launcher.pid) - killed):
                assert launcher.poll() is None, launcher.communicate()[1][-3000:]
                assert time.monotonic() < deadline, f"step {at} not reached"
                time.sleep(0.05)
            victim = rng.choice(sorted(_workers(launcher.pid) - killed))
            os.kill(victim, signal.SIGKILL)
            killed.add(victim)
        stdout, stderr = launcher.communicate(timeout=400)
        straight_out, straight_err = straight.communicate(timeout=400)
    finally:
        for proc in (launcher, straight):
            if proc.poll() is None:
                proc.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert straight.returncode == 0, straight_err[-3000:]

    a = [json.loads(r) for r in (tmp_path / "a" / "private" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(r) for r in metrics.read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))  # every step once, restarts included
    assert [(r["loss"], r["epsilon"], r["batch_size"]) for r in b] == [(r["loss"], r["epsilon"], r["batch_size"])
                                                                      for r in a]
    want, got = _final_tensors(tmp_path / "a_ck"), _final_tensors(root)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert stdout.splitlines()[-1] == straight_out.splitlines()[-1].replace(str(tmp_path / "a"), str(out))
