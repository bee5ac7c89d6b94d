"""``fsdpx train --freeze`` (issue 14, section 2): the job trains under a freezing schedule, the
frozen parameters stay exactly as they were, a resume across the change continues bit for bit,
and a sharded run follows the single-process one. The schedule's own guarantees are proved in
``tests/test_freezing.py`` and ``property_tests/test_freezing_properties.py``."""

import json
import subprocess
import sys

import pytest
import torch

import ckpt
from fsdpx.sharding import Mesh
from fsdpx.train import ConfigError, RunConfig, run
from fsdpx.train.sources import build_source

TINY = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, corpus_chars=4000, batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, seed=2)


def _params(root):
    newest = ckpt.CheckpointManager(root).latest()
    return ckpt.load(newest, mesh=Mesh(dp=1), strategy=None, private=True).params


def _losses(run_dir):
    return [json.loads(r)["loss"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_frozen_embedding_stays_as_initialised_until_it_is_unfrozen(tmp_path):
    torch.set_num_threads(1)
    initial = build_source(RunConfig.of(**TINY)).params
    common = dict(TINY, out=str(tmp_path), freeze="wte,wpe@0-3", ckpt_every=100)
    run(RunConfig.of(steps=3, name="a", ckpt_dir=str(tmp_path / "a"), **common), progress=False)
    after3 = _params(tmp_path / "a")
    assert torch.equal(after3["wte.weight"], initial["wte.weight"])
    assert torch.equal(after3["wpe.weight"], initial["wpe.weight"])
    assert not torch.equal(after3["blocks.0.mlp.fc.weight"], initial["blocks.0.mlp.fc.weight"])
    run(RunConfig.of(steps=5, name="a", ckpt_dir=str(tmp_path / "a"), resume=True, **common), progress=False)
    assert not torch.equal(_params(tmp_path / "a")["wte.weight"], initial["wte.weight"])

    run(RunConfig.of(steps=5, name="b", ckpt_dir=str(tmp_path / "b"), **common), progress=False)
    straight, resumed = _params(tmp_path / "b"), _params(tmp_path / "a")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # resumed across the change, bit for bit
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")


def test_bad_freeze_specs_are_named_errors(tmp_path):
    with pytest.raises(ConfigError, match="freeze"):
        RunConfig.of(freeze="wte@x-3")
    with pytest.raises(ConfigError, match="'nope'.*match no trainable parameter"):
        run(RunConfig.of(steps=1, freeze="nope", out=str(tmp_path), **TINY), progress=False)


def test_an_unknown_name_is_refused_before_torchrun_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fsdpx", "train", "--freeze", "wte;nope@2-", "--strategy", "zero2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nope" in done.stderr and "Traceback" not in done.stderr
    assert "launching" not in done.stderr and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_sharded_run_under_a_schedule_follows_the_single_process_run(tmp_path):
    args = ["--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000",
            "--batch-size", "16", "--noise-multiplier", "1", "--seed", "2", "--steps", "4", "--no-progress",
            "--freeze", "wte@0-2;ln_f@1-", "--out", str(tmp_path)]

    def fsdpx(*extra):
        done = subprocess.run([sys.executable, "-m", "fsdpx", "train", *args, *extra], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]

    fsdpx("--name", "one")
    fsdpx("--name", "two", "--strategy", "zero3", "--nproc", "2")
    assert _losses(tmp_path / "one") == pytest.approx(_losses(tmp_path / "two"), rel=1e-5)
