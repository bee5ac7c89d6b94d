"""A banded matrix-factorization mechanism in the private step and in ``fsdpx train``
(``--noise-mechanism banded --bands B``; a BLT's run: ``--noise-mechanism blt --buffers D``): its noise, its ledger, its batches, a resume that
continues it, and the settings refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ckpt
from fsdpx import Mesh, cli
from fsdpx.optim import sgd
from fsdpx.train.build import optimal_blt_mechanism
from fsdpx.train.resume import MechanismChangeError, check_noise_history
from privacy import DPConfig, init_state
from privacy.accounting import Accountant
from privacy.mechanisms import (BufferedToeplitz, CyclicPoissonSampler, Mechanism, banded, banded_epsilon, blt_epsilon,
                                blt_mechanism, dense_strategy)

from support.mechanism_step import steps_add_the_dense_noise
from support.threads import one_thread  # noqa: F401

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-chars", "20000",
        "--no-progress", "--batch-size", "16"]
MECH = banded((0.8, 0.5, 0.3))


def test_the_step_adds_the_mechanisms_streamed_noise():
    state, config = steps_add_the_dense_noise(MECH, torch.linalg.inv(dense_strategy(MECH, 4)))
    assert len(state.noise_history) == 2 and state.noise_history[0].keys() == state.params.keys()
    assert state.accountant.bands == 3 and state.accountant.steps == 4
    assert DPConfig(**{**config.__dict__, "mechanism": MECH.to_dict()}) == config  # read back from a checkpoint


def test_a_banded_ledger_spends_the_epsilon_of_its_participations():
    acc = Accountant(delta=1e-5, bands=3, value_discretization_interval=1e-2).record(1.2, 0.1, 10)
    assert acc.steps == 10
    assert acc.epsilon() == banded_epsilon(1.2, 0.1, 10, 3, 1e-5, value_discretization_interval=1e-2)
    # two segments of other noise: the largest over the groups of each group's own steps
    two = acc.record(0.8, 0.1, 2)  # steps 10, 11: groups 1 and 2 take the smaller noise
    ref = Accountant(delta=1e-5, value_discretization_interval=1e-2).record(1.2, 0.1, 3).record(0.8, 0.1, 1)
    assert two.epsilon() == ref.epsilon() > acc.epsilon()
    assert Accountant.from_dict(acc.to_dict()) == acc and "bands" not in Accountant(delta=1e-5).to_dict()


def _train(tmp_path, *flags):
    return cli.main(["train", "--out", str(tmp_path), *TINY, *flags])


def test_a_banded_run_samples_cyclic_groups_and_spends_its_target(tmp_path):
    _train(tmp_path, "--steps", "6", "--name", "b", "--target-epsilon", "4", "--noise-mechanism", "banded",
           "--bands", "3")
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    derived = json.loads((tmp_path / "b" / "config.json").read_text())["derived"]
    sigma, q = derived["noise_multiplier"], derived["sample_rate"]
    assert q == 16 / (derived["num_examples"] // 3)
    assert rows[-1]["epsilon"] == pytest.approx(banded_epsilon(sigma, q, 6, 3, 1e-5, value_discretization_interval=1e-2))
    assert 4 * (1 - 2e-3) <= rows[-1]["epsilon"] <= 4
    assert rows[0]["epsilon"] == rows[1]["epsilon"] == rows[2]["epsilon"] < rows[3]["epsilon"]  # group 0 at 0, 3
    sampler = CyclicPoissonSampler(derived["num_examples"], q, key=0, groups=3)
    assert [r["batch_size"] for r in rows] == [len(sampler.indices(t)) for t in range(6)]


def test_a_resume_continues_the_banded_mechanism_and_refuses_a_change(tmp_path, capsys):
    flags = ["--name", "r", "--target-epsilon", "4", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2",
             "--noise-mechanism", "banded"]
    _train(tmp_path, "--steps", "4", *flags, "--bands", "2")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--out", str(tmp_path), *TINY, "--steps", "6", "--resume", *flags, "--bands", "3"])
    assert exit_.value.code == 2
    assert "the checkpoint's steps used --noise-mechanism banded --bands 2" in capsys.readouterr().err
    _train(tmp_path, "--steps", "6", "--resume", *flags, "--bands", "2")
    segments = json.loads((tmp_path / "ck" / "run.json").read_text())["segments"]
    first, second = (s["derived"]["mechanism"] for s in segments)
    assert first == second and first["kind"] == "banded"  # optimised for 4 steps, kept for 6
    # the noise history travels in the checkpoint: steps 5, 6 are those of the run branched from step 4
    _train(tmp_path, "--steps", "6", "--name", "b", "--resume-from", str(tmp_path / "ck" / "step_4"),
           *flags[2:4], "--noise-mechanism", "banded", "--bands", "2")
    resumed, branched = (_rows(tmp_path / n / "metrics.jsonl")[-2:] for n in ("r", "b"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in branched]


def test_a_blt_run_resumes_bit_for_bit_and_refuses_other_buffers(tmp_path, capsys):
    """``--noise-mechanism blt``: its epsilon is the un-amplified ledger's, its coefficients are
    recorded with the run and kept by a branch, whose steps 3 and 4 (the D buffers read back from
    the checkpoint) are the straight run's bit for bit; other buffers are refused by flag."""
    flags = ["--target-epsilon", "4", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2",
             "--noise-mechanism", "blt", "--min-separation", "2"]
    _train(tmp_path, "--steps", "4", "--name", "s", *flags, "--buffers", "2")
    segment = json.loads((tmp_path / "ck" / "run.json").read_text())["segments"][0]
    mechanism, sigma = Mechanism.from_dict(segment["derived"]["mechanism"]), segment["derived"]["noise_multiplier"]
    assert mechanism.kind == "blt" and mechanism.min_sep == 2 and len(mechanism.decays) == 2
    straight = _rows(tmp_path / "s" / "metrics.jsonl")
    assert straight[-1]["epsilon"] == blt_epsilon(sigma, mechanism, 4, 1e-5, value_discretization_interval=1e-2)
    assert 4 * (1 - 2e-3) <= straight[-1]["epsilon"] <= 4
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        _train(tmp_path, "--steps", "4", "--name", "x", "--resume-from", str(tmp_path / "ck" / "step_2"), *flags[:2],
               *flags[6:], "--buffers", "3")
    assert exit_.value.code == 2 and not (tmp_path / "x").exists()
    assert "the checkpoint's steps used --noise-mechanism blt --buffers 2 --min-separation 2" in capsys.readouterr().err
    _train(tmp_path, "--steps", "4", "--name", "b", "--resume-from", str(tmp_path / "ck" / "step_2"), *flags[:2],
           *flags[6:], "--buffers", "2")
    branched = _rows(tmp_path / "b" / "metrics.jsonl")
    assert [r["loss"] for r in branched] == [r["loss"] for r in straight]
    assert [r["epsilon"] for r in branched] == [r["epsilon"] for r in straight]
    optimised = optimal_blt_mechanism.cache_info().misses
    _train(tmp_path, "--steps", "6", "--name", "l", "--resume-from", str(tmp_path / "ck" / "step_2"),
           "--target-epsilon", "8", "--allow-budget-increase", *flags[6:], "--buffers", "2")  # keeps the recorded strategy: none optimised
    assert optimal_blt_mechanism.cache_info().misses == optimised
    assert len(_rows(tmp_path / "l" / "metrics.jsonl")) == 6


def test_a_checkpoint_without_the_noise_history_is_refused_by_flag(tmp_path, capsys):
    flags = ["--target-epsilon", "4", "--noise-mechanism", "banded", "--bands", "2"]
    _train(tmp_path, "--steps", "2", "--name", "o", "--ckpt-dir", str(tmp_path / "ck"), *flags)
    saved = tmp_path / "ck" / "step_2"
    state = ckpt.load(saved, mesh=Mesh(), strategy=None)
    assert len(state.noise_history) == 1 and state.noise_history[0].keys() == state.params.keys()
    old = tmp_path / "ck" / "old"  # as saved before the noise streamed: no history
    ckpt.save(old, state._replace(noise_history=()), mesh=Mesh(), strategy=None, private=True, step=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        _train(tmp_path, "--steps", "4", "--name", "n", "--resume-from", str(old), *flags)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "--noise-mechanism banded: the checkpoint" in last
    assert "holds 0 past noise outputs" in last
    assert not (tmp_path / "n").exists()


@pytest.mark.slow
def test_a_sharded_banded_run_branched_into_tensor_parallelism_continues_its_noise(tmp_path):
    """zero3 on 2 gloo processes, saved at step 2, branched from there into tp=2: steps 3 and 4
    add the straight run's noise (the history resharded from the optimizer-state layout), so the
    losses agree to the float32 sums of two layouts."""
    args = ["--corpus-chars", "20000", "--batch-size", "32", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
            "--seed", "3", "--noise-multiplier", "1.0", "--noise-mechanism", "banded", "--bands", "2",
            "--no-progress", "--strategy", "zero3", "--nproc", "2", "--steps", "4", "--out", str(tmp_path)]

    def fsdpx(*extra):
        done = subprocess.run([sys.executable, "-m", "fsdpx", "train", *args, *extra], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]

    fsdpx("--name", "straight", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2")
    fsdpx("--name", "branch", "--tp", "2", "--resume-from", str(tmp_path / "ck" / "step_2"))
    straight, branch = (_rows(tmp_path / n / "metrics.jsonl") for n in ("straight", "branch"))
    assert [r["step"] for r in branch] == [1, 2, 3, 4]
    assert [r["loss"] for r in branch[:2]] == [r["loss"] for r in straight[:2]]
    assert [r["loss"] for r in branch[2:]] == pytest.approx([r["loss"] for r in straight[2:]], rel=1e-5)
    assert branch[-1]["epsilon"] == straight[-1]["epsilon"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("flags,words", [
    (["--noise-mechanism", "blt"], "--noise-mechanism blt needs --buffers D"),
    (["--buffers", "2"], "--buffers 2 is for --noise-mechanism blt, not 'independent'"),
    (["--noise-mechanism", "banded", "--bands", "2", "--min-separation", "2"],
     "--min-separation 2 is for --noise-mechanism blt, not 'banded'"),
    (["--noise-mechanism", "blt", "--buffers", "2", "--non-private"],
     "--noise-mechanism blt is a way to add noise: a non-private run has none"),
    (["--noise-mechanism", "blt", "--buffers", "1", "--min-separation", "5000"],
     "--min-separation 5000 is larger than the dataset (1249 examples)"),
    (["--noise-mechanism", "blt", "--buffers", "2", "--audit-canaries", "4"], "with --noise-mechanism 'blt' is not"),
    (["--noise-mechanism", "blt", "--buffers", "0"], "argument --buffers: must be an integer >= 1"),
    (["--noise-mechanism", "banded"], "--noise-mechanism \"banded\" needs --bands B"),
    (["--bands", "3"], "--bands=3 is for --noise-mechanism banded"),
    (["--noise-mechanism", "banded", "--bands", "2", "--non-private"],
     "--noise-mechanism \"banded\" is a way to add noise: a non-private run has none"),
])
def test_mechanism_settings_it_cannot_run_are_refused_by_flag(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_:
        _train(tmp_path, "--steps", "2", *flags)
    *before, last = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and words in last
    # before it at most argparse's usage, or the run's header (a refusal that needs the dataset's size)
    assert all(line.startswith(("usage:", " ", "fsdpx train: 2 steps")) for line in before)
    assert not (tmp_path / "run").exists() and not any(tmp_path.iterdir())


def test_a_banded_segment_is_planned_on_its_groups_ledger():
    from fsdpx.train.budget import SegmentDoesNotFitError, segment_noise

    spent = Accountant(delta=1e-5, bands=4, value_discretization_interval=1e-2).record(1.0, 0.2, 6)
    sigma = segment_noise(spent, target=4.0, sample_rate=0.2, steps=14)
    assert 4.0 * (1 - 2e-3) <= spent.record(sigma, 0.2, 14).epsilon() <= 4.0
    with pytest.raises(SegmentDoesNotFitError) as err:
        segment_noise(spent, target=4.0, sample_rate=0.2, steps=400, max_noise=1.0)
    fit = err.value.steps_fit
    assert spent.record(1.0, 0.2, fit).epsilon() <= 4.0 < spent.record(1.0, 0.2, fit + 1).epsilon()


def test_a_blt_checkpoint_accounting_other_coefficients_is_refused_by_flag(tmp_path):
    """A resume takes the BLT its run recorded; a checkpoint whose ledger accounts other
    coefficients (or lacks the D buffers) cannot continue it: refused naming --noise-mechanism."""
    mech = blt_mechanism(BufferedToeplitz((0.9, 0.3), (0.4, 0.2)), min_sep=2)
    dp = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, mechanism=mech)
    state = init_state({"w": torch.zeros(3)}, sgd(0.1), key=0, config=dp)
    check_noise_history(dp, state, tmp_path)  # its own: accepted
    other = Accountant(delta=1e-5, bands=2, blt=((0.8, 0.3), (0.4, 0.2)))
    with pytest.raises(MechanismChangeError, match="--noise-mechanism blt: the checkpoint .* accounts BLT"):
        check_noise_history(dp, state._replace(accountant=other), tmp_path)
    with pytest.raises(MechanismChangeError, match="holds 1 past noise outputs, its mechanism streams from 2"):
        check_noise_history(dp, state._replace(noise_history=({},)), tmp_path)
