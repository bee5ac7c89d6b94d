"""``fsdpx train --offload`` with ``--tp`` and ``--pp`` on real gloo processes (issue 31, item 3):
each rank offloads its own block of its own stage's weights and the run follows the
one-process run. The equalities on random models are
``property_tests/test_zenflow_model_parallel.py``; what stays refused is named in
``tests/test_cli.py::test_parallelism_flags_that_cannot_work_are_refused``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ARGS = ["--corpus-chars", "4000", "--batch-size", "16", "--n-layer", "2", "--n-embd", "8", "--n-head", "2",
        "--block-size", "8", "--seed", "2", "--noise-multiplier", "1", "--no-progress", "--steps", "6"]
FREEZE = ["--freeze", "wte,wpe@0-3;blocks.0.mlp.fc@2-5"]
ZENFLOW = ["--offload", "zenflow", "--offload-interval", "2", "--offload-topk", "0.25"]


def _losses(run_dir) -> list[float]:
    return [json.loads(r)["loss"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, name: str, *extra: str) -> list[float]:
    done = subprocess.run([sys.executable, "-m", "fsdpx", "train", *ARGS, *extra, "--name", name, "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(tmp_path / name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--microbatches", "2"]], ids=["tp2", "pp2"])
def test_zenflow_under_a_schedule_on_two_gloo_ranks_follows_one_process(tmp_path, layout):
    """Private, with a freezing schedule (a 2-D weight frozen mid-window: its landed columns
    wait): ``--tp 2`` (row-parallel weights' columns split, selected on the whole vector) and
    ``--pp 2`` (each stage its own weights) give the one-process losses (float32, rel 1e-5)."""
    one = _train(tmp_path, "one", *ZENFLOW, *FREEZE)
    two = _train(tmp_path, "two", *ZENFLOW, *FREEZE, "--strategy", "zero3", "--nproc", "2", *layout)
    assert len(one) == 6 and two == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--microbatches", "2"]], ids=["tp2", "pp2"])
def test_zero_offload_with_model_parallelism_resumes_from_its_checkpoint(tmp_path, layout):
    """ZeRO-Offload's state is per parameter, so a ``--tp 2`` or ``--pp 2`` run checkpoints and
    resumes as any sharded run does: the resumed losses are the straight run's, bit for bit.
    (Without a freezing schedule: its per-parameter counts differ between pipeline stages, which
    a checkpoint's non-tensor state may not.)"""
    two = ["--offload", "zero", "--strategy", "zero3", "--nproc", "2", *layout]
    straight = _train(tmp_path, "straight", *two)
    ck = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "3"]
    _train(tmp_path, "resumed", *two, *ck, "--steps", "3")
    resumed = _train(tmp_path, "resumed", *two, *ck, "--resume")
    assert resumed == straight and len(straight) == 6
