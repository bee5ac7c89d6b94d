"""Gradient canaries inside a run (``privacy.gradient_canaries``, ``fsdpx train --audit-canaries``):
pure functions of (key, step, canary); the sharded layouts add exactly what one process adds;
an audit of a run without its noise exceeds the claim, of the real run stays below it; the CLI
reports the audit in the summary, keeps it across a resume, and refuses what it cannot audit."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fsdpx import Mesh, strategies
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.optim import sgd
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
from fsdpx.sharding.tensor_parallel import resolve
from privacy import DPConfig, init_state, make_private_step
from privacy.accounting import epsilon
from privacy.audit import audit_gradient_canaries
from privacy.errors import PrivacyError
from privacy.gradient_canaries import GradientCanaries

from support.mesh_runs import pipelined_run, sharded_run, tensor_parallel_run
from support.threads import one_thread  # noqa: F401

PARAMS = (("a", 60), ("b", 7), ("c", 300))


def canaries(count=40, rate=0.5, key=3) -> GradientCanaries:
    return GradientCanaries(count=count, key=key, norm=2.0, sample_rate=rate, params=PARAMS)


def test_canaries_are_distinct_seeded_and_join_at_the_rate():
    c = canaries(count=300, rate=0.25)
    which, index = c.coordinates
    assert len({(int(w), int(i)) for w, i in zip(which, index)}) == 300
    assert all(0 <= i < PARAMS[w][1] for w, i in zip(which, index))
    assert 0.4 < c.included.mean() < 0.6
    joined = np.mean([c.joining(t)[c.included].mean() for t in range(40)])
    assert 0.2 < joined < 0.3 and not any(c.joining(t)[~c.included].any() for t in range(40))
    again = canaries(count=300, rate=0.25)
    assert all(np.array_equal(x, y) for x, y in zip(c.coordinates, again.coordinates))
    assert not np.array_equal(c.included, canaries(count=300, rate=0.25, key=4).included)


@pytest.mark.parametrize("box", [((0, 20), (0, 15)), ((0, 20), (5, 11)), ((7, 9), (0, 15)), ((3, 3), (0, 15))])
def test_boxes_add_what_the_whole_tensor_gets(box):
    c = GradientCanaries(count=100, key=5, norm=1.5, sample_rate=0.7, params=(("w", 300), ("v", 4)))
    whole = {"w": torch.zeros(300, dtype=torch.float64), "v": torch.zeros(4, dtype=torch.float64)}
    c.add_(whole, step=2)
    block = torch.zeros(tuple(b - a for a, b in box), dtype=torch.float64)
    c.add_box_(block, "w", (20, 15), box, step=2)
    assert torch.equal(block, whole["w"].view(20, 15)[tuple(slice(a, b) for a, b in box)])
    assert whole["w"].sum() > 0 and set(whole["w"].unique().tolist()) <= {0.0, 1.5}


@pytest.mark.parametrize("kwargs,says", [(dict(count=1), ">= 2"), (dict(count=400), "need as many"),
                                         (dict(sample_rate=0.0), "sample rate")])
def test_bad_canaries_are_named_errors(kwargs, says):
    args = dict(count=10, key=0, norm=1.0, sample_rate=0.5, params=PARAMS) | kwargs
    with pytest.raises(PrivacyError, match=says):
        GradientCanaries(**args)


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=13, block_size=4, n_layer=2, n_head=2, n_embd=6)).double()


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 13, (5, 4), generator=g), torch.randint(0, 13, (5, 4), generator=g)) for _ in range(n)]


def _config(model, noise=0.5) -> DPConfig:
    params = tuple((k, v.numel()) for k, v in model.named_parameters())
    c = GradientCanaries(count=30, key=7, norm=0.5, sample_rate=0.6, params=params)
    return DPConfig(clip_norm=0.5, noise_multiplier=noise, sample_rate=0.1, method="ghost", canaries=c)


def _one_process(model, config, batches):
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = init_state(params, sgd(0.1), key=7, config=config)
    step = make_private_step(model, token_loss, sgd(0.1), config, num_examples=50)
    for b in batches:
        state, _ = step(state, b)
    return state.params


@pytest.mark.parametrize("layout", ["zero3", "tp2", "pp2"])
def test_sharded_layouts_add_the_canaries_one_process_adds(one_thread, layout):
    model, batches = _gpt(), _batches()
    config = _config(model)
    want = _one_process(model, config, batches)
    if layout == "zero3":
        got, _, _ = sharded_run(model, batches, sgd(0.1), config, strategies.zero3(), Mesh(dp=2))
    elif layout == "tp2":
        mesh = Mesh(dp=1, tp=2)
        got, _ = tensor_parallel_run(model, batches, sgd(0.1), config,
                                     resolve(model, gpt_plan(model.config), strategies.zero3(), mesh), mesh)
    else:
        mesh = Mesh(dp=1, pp=2)
        plan = resolve_pipeline(model, resolve(model, None, strategies.ddp(), mesh),
                                PipelineParallel(schedule="1f1b", microbatches=5), mesh)
        got, _ = pipelined_run(model, batches, sgd(0.1), plan, mesh, config)
    without = _one_process(model, DPConfig(**{**config.__dict__, "canaries": None}), batches)
    moved = max(float((want[k] - without[k]).abs().max()) for k in want)
    assert moved >= 0.01  # the canaries moved their coordinates (lr * norm / (q N) = 0.01 a join)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-10)


def _audit(noise: float, claimed_noise: float, seed: int = 0):
    """A linear model on random data, 8 SGD steps with 500 canaries; the audit against the
    epsilon of ``claimed_noise``."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64, bias=False).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    c = GradientCanaries(count=500, key=seed, norm=1.0, sample_rate=0.5, params=(("weight", 64 * 64),))
    config = DPConfig(clip_norm=1.0, noise_multiplier=noise, sample_rate=0.5, method="vmap", canaries=c)
    x = torch.randn(40, 64, dtype=torch.float64)

    def loss_fn(out, y):
        return ((out - y) ** 2).sum(-1)

    y = torch.randn(40, 64, dtype=torch.float64)
    state = init_state(params, sgd(1.0), key=seed, config=config)
    step = make_private_step(model, loss_fn, sgd(1.0), config, num_examples=40)
    initial = c.values(state.params)
    g = torch.Generator().manual_seed(seed)
    for _ in range(8):
        pick = torch.rand(40, generator=g) < 0.5
        state, _ = step(state, (x[pick], y[pick]))
    claim = epsilon(claimed_noise, 0.5, 8, 1e-5)
    return audit_gradient_canaries(c, initial, c.values(state.params), claimed_epsilon=claim, delta=1e-5)


def test_canaries_without_noise_exceed_the_claim(one_thread):
    report = _audit(noise=0.0, claimed_noise=4.0)
    assert report.verdict == "exceeds" and report.correct == report.guesses == 100, report


def test_a_private_run_with_canaries_is_consistent(one_thread):
    report = _audit(noise=4.0, claimed_noise=4.0)
    assert report.verdict == "consistent" and report.epsilon_lower < report.claimed_epsilon, report


def _train(tmp_path, *args):
    cmd = [sys.executable, "-m", "fsdpx", "train", "--out", str(tmp_path), "--steps", "4", "--batch-size", "64",
           "--n-layer", "1", "--n-embd", "32", "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_cli_audits_the_run_and_a_resume_keeps_its_canaries(tmp_path):
    first = _train(tmp_path, "--name", "a", "--audit-canaries", "200", "--ckpt-dir", str(tmp_path / "ck"))
    assert first.returncode == 0, first.stderr[-3000:]
    line = next(l for l in first.stdout.splitlines() if l.startswith("audit "))
    assert "guesses right, 200 canaries" in line and "consistent with the claim" in line, line
    saved = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert saved["count"] == 200 and len(saved["initial"]) == 200
    more = _train(tmp_path, "--name", "a", "--audit-canaries", "200", "--ckpt-dir", str(tmp_path / "ck"), "--resume",
                  "--steps", "6")
    assert more.returncode == 0, more.stderr[-3000:]
    assert any(l.startswith("audit ") and "200 canaries" in l for l in more.stdout.splitlines()), more.stdout
    assert json.loads((tmp_path / "a" / "audit.json").read_text()) == saved


@pytest.mark.parametrize("args,says", [
    (["--audit-canaries", "1"], "--audit-canaries must be an integer >= 2"),
    (["--audit-canaries", "100", "--non-private"], "audit"),
    (["--audit-canaries", "100", "--freeze", "wte@0-2"], "freeze"),
    (["--audit-canaries", "100", "--noise-mechanism", "banded", "--bands", "2"], "banded"),
])
def test_what_the_audit_cannot_check_is_refused_before_writing(tmp_path, args, says):
    done = _train(tmp_path, "--name", "r", *args)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "r").exists()
