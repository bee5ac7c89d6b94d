"""A run in segments (issue 15, section 2; issue 14's metrics bug): resume and branch from any
intact checkpoint, the record of every segment, the metrics cut back, what a resume may change,
and the Python helper with the CLI's guarantee. Tiny model, single process."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from fsdpx.train import RunConfig, cli, run
from fsdpx.train.preflight import CheckpointDirInUseError, RunDirExistsError
from fsdpx.train.report import format_summary
from fsdpx.train.resume import resume_from
from fsdpx.train.segments import (BranchError, CheckpointNotFoundError, DataChangeError, ModelChangeError,
                                  PrivacyModeChangeError, cut_back)

TINY = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, corpus_chars=4000, batch_size=16.0, target_epsilon=4.0)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _bits(rows):
    return [{k: v for k, v in r.items() if k not in ("step_seconds", "elapsed_seconds")} for r in rows]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cfg(tmp_path, name="a", **kw):
    return RunConfig.of(out=str(tmp_path), name=name, **{**TINY, **kw})


def test_cut_back_keeps_each_step_once_up_to_the_start():
    rows = [{"step": s} for s in (1, 2, 3, 4, 2, 3, 4, 5)]
    assert [r["step"] for r in cut_back(rows, 3)] == [1, 2, 3]
    assert cut_back(rows, 0) == []


def test_a_resume_cuts_the_metrics_back_to_its_checkpoint(tmp_path):
    """Issue 14: a run that logged steps 1-10 but whose newest checkpoint is step 6 (as if
    killed before the next save) resumes at 6: the log holds steps 1..10 once, equal to the
    straight run's (the same noise: the run's own, kept)."""
    run(_cfg(tmp_path, "straight", steps=10), progress=False)
    ck = str(tmp_path / "ck")
    run(_cfg(tmp_path, steps=10, ckpt_dir=ck, ckpt_every=3), progress=False)
    for lost in (9, 10):
        shutil.rmtree(Path(ck) / f"step_{lost}")
    summary = run(_cfg(tmp_path, steps=10, ckpt_dir=ck, ckpt_every=3, resume=True), progress=False)
    rows = _rows(tmp_path / "a")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert _bits(rows) == _bits(_rows(tmp_path / "straight"))
    assert summary["start_step"] == 6 and summary["steps"] == 10 and summary["segment_starts"] == [6]
    assert "at step 1 ->" in format_summary(summary) and "segments start at steps 6" in format_summary(summary)
    segments = json.loads((tmp_path / "a" / "config.json").read_text())["segments"]
    assert [s["start_step"] for s in segments] == [0, 6]
    assert segments[1]["source_checkpoint"] == str((Path(ck) / "step_6").resolve())


def test_resume_with_nothing_left_to_do_says_so_and_writes_nothing(tmp_path, capsys):
    flags = ["train", "--out", str(tmp_path), "--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8",
             "--corpus-chars", "4000", "--batch-size", "16", "--no-progress", "--ckpt-dir", str(tmp_path / "ck"),
             "--steps", "3"]
    cli.main(flags)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    cli.main([*flags, "--resume"])
    out = capsys.readouterr()
    assert "nothing to do: the checkpoint" in out.err and "is at step 3 and --steps is 3" in out.err
    assert "loss" in out.out and "at step 1" in out.out
    assert "files        none written" in out.out and "metrics.jsonl" not in out.out
    assert _snapshot(tmp_path) == before


TINY_FLAGS = ["--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000",
              "--batch-size", "16", "--target-epsilon", "4", "--no-progress"]


def test_a_branch_with_nothing_to_do_names_no_files(tmp_path, capsys):
    """Issue 28: a branch from a checkpoint already at ``--steps`` printed a ``files
    runs/branch-a/{metrics.jsonl,...}`` line for files it never wrote."""
    ck = tmp_path / "ck"
    cli.main(["train", "--out", str(tmp_path), "--name", "a", *TINY_FLAGS, "--steps", "3", "--ckpt-dir", str(ck)])
    capsys.readouterr()
    cli.main(["train", "--resume-from", str(ck / "step_3"), "--name", "branch-a", "--no-progress"])
    out = capsys.readouterr()
    assert "nothing to do" in out.err
    assert "files        none written" in out.out and "branch-a/{" not in out.out
    assert not (tmp_path / "branch-a").exists()


def test_a_resume_names_the_noise_the_run_used(tmp_path, capsys):
    """Issue 28: a resume with more ``--steps`` said "noise multiplier 1.148 (was 0.4883)", where
    0.4883 was what a fresh run of the new ``--steps`` would use and the run had used 0.4689.
    The line now names the noise of the run's last step before the checkpoint (its record in
    ``config.json``), and not the fresh run's."""
    ck = tmp_path / "ck"
    first = ["train", "--out", str(tmp_path), "--name", "a", *TINY_FLAGS, "--ckpt-dir", str(ck)]
    cli.main([*first, "--steps", "4"])
    used = json.loads((tmp_path / "a" / "config.json").read_text())["derived"]["noise_multiplier"]
    cli.main(["train", "--out", str(tmp_path), "--name", "fresh", *TINY_FLAGS, "--steps", "6"])
    fresh = json.loads((tmp_path / "fresh" / "config.json").read_text())["derived"]["noise_multiplier"]
    capsys.readouterr()
    cli.main(["train", "--ckpt-dir", str(ck), "--resume", "--steps", "6", "--no-progress"])
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "noise multiplier" in x)
    new = json.loads((tmp_path / "a" / "config.json").read_text())["segments"][-1]["derived"]["noise_multiplier"]
    assert f"noise multiplier {new:.4g} for the 2 steps left" in line
    assert f"(step 4, the last before the checkpoint, used {used:.4g})" in line
    assert f"{fresh:.4g}" not in line and fresh != used


def test_changes_a_resume_cannot_honour_are_named_errors_before_anything_runs(tmp_path):
    ck = str(tmp_path / "ck")
    run(_cfg(tmp_path, steps=2, ckpt_dir=ck), progress=False)
    before = _snapshot(tmp_path)
    refused = [
        (ModelChangeError, dict(n_embd=16, n_head=2)),
        (DataChangeError, dict(corpus_chars=5000)),
        (PrivacyModeChangeError, dict(private=False)),
    ]
    for error, change in refused:
        with pytest.raises(error):
            run(_cfg(tmp_path, steps=4, ckpt_dir=ck, resume=True, **change), progress=False)
    assert _snapshot(tmp_path) == before
    plain = str(tmp_path / "plain")
    run(_cfg(tmp_path, "p", steps=2, ckpt_dir=plain, private=False), progress=False)
    with pytest.raises(PrivacyModeChangeError, match="non-private run; it cannot be resumed as a private"):
        run(_cfg(tmp_path, "p", steps=4, ckpt_dir=plain, resume=True), progress=False)
    new_data = run(_cfg(tmp_path, steps=4, ckpt_dir=ck, resume=True, corpus_chars=5000, allow_new_data=True),
                   progress=False)
    assert new_data["steps"] == 4
    assert json.loads((tmp_path / "a" / "config.json").read_text())["segments"][1]["new_data"] is True


def test_allowed_changes_on_resume_are_recorded_per_segment(tmp_path):
    """Optimizer, clip norm, batch size, noise, steps and checkpoint cadence may change; each
    segment's resolved values are in config.json; the whole run stays within its budget (the
    second segment spends the target of 4; the third a budget raised to 5, explicitly)."""
    ck = str(tmp_path / "ck")
    run(_cfg(tmp_path, steps=3, ckpt_dir=ck), progress=False)
    run(_cfg(tmp_path, steps=5, ckpt_dir=ck, resume=True, lr=3e-3, clip_norm=0.5, batch_size=32.0, ckpt_every=1),
        progress=False)
    last = run(_cfg(tmp_path, steps=6, ckpt_dir=ck, resume=True, noise_multiplier=3.0, target_epsilon=None,
                    epsilon_budget=5.0, allow_budget_increase=True), progress=False)
    segments = json.loads((tmp_path / "a" / "config.json").read_text())["segments"]
    assert [s["start_step"] for s in segments] == [0, 3, 5]
    assert [s["config"]["run"]["lr"] for s in segments] == [1e-2, 3e-3, 1e-2]
    assert [s["config"]["privacy"]["clip_norm"] for s in segments] == [1.0, 0.5, 1.0]
    assert segments[1]["derived"]["sample_rate"] == 2 * segments[0]["derived"]["sample_rate"]
    assert segments[2]["derived"]["noise_multiplier"] == 3.0
    assert [r["step"] for r in _rows(tmp_path / "a")] == [1, 2, 3, 4, 5, 6]
    assert 4.0 < last["epsilon"] <= 5.0


def test_a_branch_never_writes_where_its_source_lives(tmp_path):
    ck = tmp_path / "ck"
    run(_cfg(tmp_path, steps=4, ckpt_dir=str(ck), ckpt_every=2), progress=False)
    source = _snapshot(tmp_path / "a"), _snapshot(ck)
    with pytest.raises(CheckpointDirInUseError, match="ck already holds step_2, step_4: a new run there would mix"):
        run(_cfg(tmp_path, "b", steps=6, resume_from=str(ck / "step_2"), ckpt_dir=str(ck)), progress=False)
    with pytest.raises(RunDirExistsError, match="already holds a run"):
        run(_cfg(tmp_path, "a", steps=6, resume_from=str(ck / "step_2")), progress=False)
    with pytest.raises(BranchError, match="source's run directory"):  # not even with --overwrite
        run(_cfg(tmp_path, "a", steps=6, resume_from=str(ck / "step_2"), overwrite=True), progress=False)
    with pytest.raises(CheckpointNotFoundError):
        run(_cfg(tmp_path, "b", steps=6, resume_from=str(ck / "step_3")), progress=False)
    # a branch from the older checkpoint, long enough for its retention to delete its own
    run(_cfg(tmp_path, "b", steps=8, resume_from=str(ck / "step_2"), ckpt_every=1), progress=False)
    assert (_snapshot(tmp_path / "a"), _snapshot(ck)) == source
    assert ckpt.CheckpointManager(tmp_path / "b" / "ckpt").steps() == [6, 7, 8]
    assert [r["step"] for r in _rows(tmp_path / "b")] == list(range(1, 9))
    assert _bits(_rows(tmp_path / "b"))[:2] == _bits(_rows(tmp_path / "a"))[:2]
    with pytest.raises(CheckpointDirInUseError, match="already holds step_6, step_7, step_8"):
        run(_cfg(tmp_path, "b", steps=8, resume_from=str(ck / "step_2"), overwrite=True), progress=False)
    assert (_snapshot(tmp_path / "a"), _snapshot(ck)) == source


def test_a_branch_run_twice_from_one_checkpoint_gives_the_same_bits(tmp_path):
    ck = tmp_path / "ck"
    run(_cfg(tmp_path, steps=4, ckpt_dir=str(ck), ckpt_every=2), progress=False)
    for name in ("b1", "b2"):
        run(_cfg(tmp_path, name, steps=7, resume_from=str(ck / "step_2"), lr=3e-3, batch_size=24.0), progress=False)
    assert _bits(_rows(tmp_path / "b1")) == _bits(_rows(tmp_path / "b2"))
    states = [ckpt.load(tmp_path / n / "ckpt" / "step_7", mesh=ckpt.CheckpointManager(ck).mesh, strategy=None,
                        private=True) for n in ("b1", "b2")]
    assert all(torch.equal(states[0].params[k], states[1].params[k]) for k in states[0].params)
    assert states[0].accountant == states[1].accountant and states[0].accountant.epsilon() <= 4.0


def test_a_cli_branch_keeps_the_flags_it_does_not_set(tmp_path):
    """``--resume-from ck/step_2 --lr 0.003 --name b`` with no model flags: the source's model,
    data and target, the new learning rate."""
    ck = tmp_path / "ck"
    cli.main(["train", "--out", str(tmp_path), "--name", "a", "--n-layer", "1", "--n-embd", "8", "--n-head", "1",
              "--block-size", "8", "--corpus-chars", "4000", "--batch-size", "16", "--target-epsilon", "4",
              "--steps", "3", "--ckpt-dir", str(ck), "--ckpt-every", "2", "--no-progress"])
    cli.main(["train", "--resume-from", str(ck / "step_2"), "--lr", "0.003", "--name", "b", "--steps", "4",
              "--no-progress"])
    config = RunConfig.from_dict(json.loads((tmp_path / "b" / "config.json").read_text())).flat()
    assert (config["n_embd"], config["corpus_chars"], config["target_epsilon"], config["lr"]) == (8, 4000, 4.0, 0.003)
    assert config["ckpt_dir"] == str(tmp_path / "b" / "ckpt") and config["resume_from"] == str(ck / "step_2")


def test_resume_from_in_python_gives_the_cli_noise_and_state(tmp_path):
    ck = tmp_path / "ck"
    run(_cfg(tmp_path, steps=4, ckpt_dir=str(ck), ckpt_every=2), progress=False)
    state, dp = resume_from(ck / "step_2", {"steps": 12, "lr": 3e-3})
    assert state.step == 2 and state.accountant.steps == 2 and state.accountant.epsilon_budget == 4.0
    assert state.accountant.record(dp.noise_multiplier, dp.sample_rate, 10).epsilon() <= 4.0
    run(_cfg(tmp_path, "b", steps=12, lr=3e-3, resume_from=str(ck / "step_2")), progress=False)
    segment = json.loads((tmp_path / "b" / "config.json").read_text())["segments"][-1]
    assert dp.noise_multiplier == segment["derived"]["noise_multiplier"]
    with pytest.raises(ModelChangeError):
        resume_from(ck / "step_2", {"n_embd": 16, "n_head": 2})
