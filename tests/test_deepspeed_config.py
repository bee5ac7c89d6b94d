"""``fsdpx train`` with ZenFlow's DeepSpeed knobs (issue 31): the ``--offload-*`` flags, the
``[offload]`` keys and ``--deepspeed-config ds.json`` (``fsdpx.train.deepspeed``), through the
real command line on the tiny built-in GPT; refusals are one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fsdpx.train import cli
from support.threads import one_thread  # noqa: F401 - autouse fixture

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-chars", "20000",
        "--no-progress", "--non-private", "--batch-size", "16", "--no-export"]
ZENFLOW = {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 4, "update_interval": 2,
           "full_warm_up_rounds": 1, "overlap_step": True}


def _ds(tmp_path: Path, zenflow: dict | None = None, optimizer: dict | None = None, **top) -> Path:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True} if optimizer is None else optimizer}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**top, "zero_optimization": zero}))
    return path


def _train(tmp_path: Path, *flags: str) -> Path:
    cli.main(["train", "--out", str(tmp_path / "runs"), "--name", "r", *TINY, *flags])
    return tmp_path / "runs" / "r"


def _offload(run_dir: Path) -> dict:
    return tomllib.loads((run_dir / "config.toml").read_text())["offload"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _refused(tmp_path: Path, capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        _train(tmp_path, *flags)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()
    return err


@pytest.mark.slow  # a fresh interpreter: 20-60 s on a busy 2-core machine
def test_a_deepspeed_file_sets_the_offload_and_flags_win_over_it(tmp_path):
    """Through ``python -m fsdpx train``: the file's zenflow block becomes the run's ``[offload]``
    (recorded in config.toml), a flag typed beside it wins, and the other sections are named in
    one line as not read."""
    ds = _ds(tmp_path, ZENFLOW, train_batch_size=8, fp16={"enabled": True})
    argv = [sys.executable, "-m", "fsdpx", "train", "--out", str(tmp_path / "runs"), "--name", "r", *TINY,
            "--steps", "3", "--deepspeed-config", str(ds), "--offload-interval", "3", "--offload-select-interval", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "not read" in line]
    assert notes == [f"fsdpx train: --deepspeed-config {ds}: not read (fsdpx's own settings apply): train_batch_size,"
                     " fp16, zero_optimization.stage"]
    assert _offload(tmp_path / "runs" / "r") == {
        "kind": "zenflow", "topk": 0.25, "interval": 3, "select_strategy": "step", "select_interval": 3,
        "full_warm_up_rounds": 1, "overlap_step": True, "host_process": False, "host_threads": 1, "host_cores": "",
        "deepspeed_config": str(ds)}
    assert "every 3 steps, after 1 steps of plain AdamW, reselecting every 3 steps" in done.stderr


def test_missing_zenflow_keys_take_deepspeeds_defaults_and_config_file_keys_win(tmp_path):
    ds = _ds(tmp_path, {"topk_ratio": 0.5})
    toml = tmp_path / "run.toml"
    toml.write_text(f'steps = 2\n[offload]\ndeepspeed_config = "{ds}"\ntopk = 0.2\n')
    run_dir = _train(tmp_path, "--config", str(toml))
    assert _offload(run_dir) == {"kind": "zenflow", "topk": 0.2, "interval": "auto", "select_strategy": "auto",
                                 "select_interval": "auto", "full_warm_up_rounds": 0, "overlap_step": False,
                                 "host_process": False, "host_threads": 1, "host_cores": "",
                                 "deepspeed_config": str(ds)}


def test_offload_optimizer_on_the_cpu_without_zenflow_is_zero_offload(tmp_path):
    run_dir = _train(tmp_path, "--steps", "1", "--deepspeed-config", str(_ds(tmp_path)))
    assert _offload(run_dir)["kind"] == "zero"


def test_warm_up_steps_are_plain_adamw_through_the_cli(tmp_path):
    """Four steps with a warm-up of three give the losses of four plain AdamW steps, bit for bit:
    step 4's loss is computed on the weights the three warm-up updates left."""
    warm = _train(tmp_path / "a", "--steps", "4", "--offload", "zenflow", "--offload-full-warm-up-rounds", "3",
                  "--offload-topk", "0.25", "--offload-interval", "2")
    plain = _train(tmp_path / "b", "--steps", "4")
    zenflow = _train(tmp_path / "c", "--steps", "4", "--offload", "zenflow", "--offload-topk", "0.25",
                     "--offload-interval", "2")
    assert _losses(warm) == _losses(plain)
    assert _losses(zenflow)[3] != _losses(plain)[3]


def test_overlap_step_does_not_change_a_bit(tmp_path):
    runs = [_train(tmp_path / flag, "--steps", "5", "--offload", "zenflow", "--offload-interval", "2",
                   "--offload-full-warm-up-rounds", "1", flag) for flag in ("--offload-overlap-step",
                                                                            "--no-offload-overlap-step")]
    assert _losses(runs[0]) == _losses(runs[1])


@pytest.mark.parametrize("zenflow, optimizer, words", [
    ({**ZENFLOW, "auto_ratio": 0.9, "pt_reserved_cores_perc": 0.5}, None,
     "fsdpx does not read zero_optimization.zenflow.auto_ratio, zero_optimization.zenflow.pt_reserved_cores_perc"),
    (ZENFLOW, {"device": "cpu", "nvme_path": "/nvme"},
     "fsdpx does not read zero_optimization.offload_optimizer.nvme_path"),
    (ZENFLOW, {"device": "nvme"}, "offload_optimizer.device: fsdpx offloads to \"cpu\""),
    (ZENFLOW, {"device": "cpu", "pin_memory": False}, "offload_optimizer.pin_memory"),
    ({"select_strategy": "auto", "select_interval": 3}, None, "zenflow.select_strategy \"auto\" reselects every epoch"),
    ({"select_strategy": "epoch"}, None, "zenflow.select_strategy 'epoch' needs a select_interval"),
    ({"update_interval": "often"}, None, "zenflow.update_interval must be an integer or \"auto\", got 'often'"),
    ({"topk_ratio": 1.5}, None, "zenflow.topk_ratio must be in [0, 1], got 1.5"),
])
def test_deepspeed_keys_fsdpx_cannot_honour_are_refused_by_name(tmp_path, capsys, zenflow, optimizer, words):
    err = _refused(tmp_path, capsys, "--steps", "1", "--deepspeed-config", str(_ds(tmp_path, zenflow, optimizer)))
    assert "--deepspeed-config" in err and words in err, err


def test_a_deepspeed_file_that_is_not_json_is_refused(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text("{zero_optimization: }")
    assert "not valid JSON" in _refused(tmp_path, capsys, "--deepspeed-config", str(bad))


@pytest.mark.parametrize("flags, words", [
    (["--offload-select-strategy", "auto", "--offload-select-interval", "3"],
     "--offload-select-strategy \"auto\" reselects every epoch: drop --offload-select-interval"),
    (["--offload-select-interval", "6", "--offload-interval", "4"],
     "--offload-select-interval=6 must be a multiple of --offload-interval=4"),
    (["--offload-select-strategy", "epoch", "--offload-select-interval", "auto"], "with \"epoch\" give a number"),
    (["--offload-interval", "sometimes"], "must be an integer >= 1 or auto, got sometimes"),
    (["--offload-full-warm-up-rounds", "-1"], "must be an integer >= 0"),
])
def test_knob_flags_that_cannot_work_are_refused_naming_the_flag(tmp_path, capsys, flags, words):
    err = _refused(tmp_path, capsys, "--steps", "1", "--offload", "zenflow", *flags)
    assert words in err, err


def test_knob_keys_in_a_config_file_are_checked_like_the_flags(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('[offload]\nkind = "zenflow"\ninterval = "never"\n')
    err = _refused(tmp_path, capsys, "--config", str(toml))
    assert "[offload] interval" in err and "never" in err, err
