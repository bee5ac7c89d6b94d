"""``fsdpx train --optimizer {adamw,sgd} --momentum X``: the optimizer a run trains with, kept by
its resumes."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckpt
from fsdpx import Mesh, cli

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-chars", "20000",
        "--no-progress", "--batch-size", "16"]
SGD = ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"]


def _train(tmp_path, *flags):
    return cli.main(["train", "--out", str(tmp_path), *TINY, *flags])


def _refused(tmp_path, capsys, *flags) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        _train(tmp_path, *flags)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def sgd_run(tmp_path):
    """A private banded run of 2 steps with SGD and momentum 0.9, a checkpoint after each step."""
    _train(tmp_path, "--steps", "2", "--name", "s", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1",
           "--target-epsilon", "8", "--noise-mechanism", "banded", "--bands", "2", *SGD)
    return tmp_path / "ck"


def test_sgd_with_momentum_updates_by_its_buffer(sgd_run):
    """Each step is ``p <- p - lr * buf`` with ``buf <- 0.9 buf + g`` (``fsdpx.optim.sgd``): the
    checkpoints hold one momentum buffer per parameter, and step 2's parameters are step 1's
    minus lr times step 2's buffer, bit for bit."""
    one, two = (ckpt.load(sgd_run / f"step_{s}", mesh=Mesh(), strategy=None) for s in (1, 2))
    assert two.opt_state["count"] == 2 and set(two.opt_state) == {"count", "momentum"}
    assert two.opt_state["momentum"].keys() == two.params.keys()
    for k, p in two.params.items():
        assert torch.equal(p, one.params[k] - 0.05 * two.opt_state["momentum"][k]), k
        assert not torch.equal(two.opt_state["momentum"][k], one.opt_state["momentum"][k]), k


def test_a_resume_keeps_the_optimizer_and_refuses_another(sgd_run, tmp_path, capsys):
    step_1 = str(sgd_run / "step_1")
    last = _refused(tmp_path, capsys, "--steps", "2", "--name", "a", "--resume-from", step_1, "--optimizer", "adamw")
    assert "--optimizer adamw: the checkpoint's steps used --optimizer sgd --momentum 0.9" in last
    assert not (tmp_path / "a").exists()
    bare = tmp_path / "bare" / "step_1"  # no run.json beside it: the state tensors tell
    shutil.copytree(step_1, bare)
    last = _refused(tmp_path, capsys, "--steps", "2", "--name", "b", "--resume-from", str(bare), "--optimizer", "sgd")
    assert "--optimizer sgd: the checkpoint's steps used --optimizer sgd --momentum (nonzero)" in last
    assert not (tmp_path / "b").exists()
    _train(tmp_path, "--steps", "2", "--name", "c", "--resume-from", step_1, "--target-epsilon", "8",
           "--noise-mechanism", "banded", "--bands", "2", "--optimizer", "sgd", "--momentum", "0.5")  # a new value


def test_momentum_without_sgd_is_refused_by_name(tmp_path, capsys):
    last = _refused(tmp_path, capsys, "--steps", "1", "--momentum", "0.9")
    assert "momentum 0.9" in last and "sgd" in last
    assert list(tmp_path.iterdir()) == []
