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
    wait) and the ``"auto"`` intervals: ``--tp 2`` (row-parallel weights' columns split,
    selected on the whole vector) and ``--pp 2`` (each stage its own weights; the window rule's
    sums all-reduced over both stages) give the one-process losses (float32, rel 1e-5)."""
    auto = [*ZENFLOW[:2], "--offload-topk", "0.25", "--offload-interval", "auto", "--offload-select-interval", "auto"]
    one = _train(tmp_path, "one", *auto, *FREEZE)
    two = _train(tmp_path, "two", *auto, *FREEZE, "--strategy", "zero3", "--nproc", "2", *layout)
    assert len(one) == 6 and two == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--microbatches", "2"]], ids=["tp2", "pp2"])
def test_zero_offload_under_a_schedule_with_model_parallelism_resumes_bit_for_bit(tmp_path, layout):
    """ZeRO-Offload's state is per parameter, so a ``--tp 2`` or ``--pp 2`` run under a freezing
    schedule that freezes the first stage's weights only checkpoints and resumes as any sharded
    run does: the stages' counts are saved one per parameter (``offload.zero_offload.
    per_parameter_counts``) and each rank keeps its own stage's on loading; a run branched from
    step 3 gives the straight run's losses bit for bit and saves its own step 6."""
    two = ["--offload", "zero", "--freeze", "blocks.0.mlp.fc@2-5", "--strategy", "zero3", "--nproc", "2", *layout]
    straight = _train(tmp_path, "straight", *two, "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "3")
    branch = _train(tmp_path, "branch", *two, "--resume-from", str(tmp_path / "ck" / "step_3"))
    assert branch == straight and len(straight) == 6
    assert (tmp_path / "branch" / "ckpt" / "step_6").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--microbatches", "2"]], ids=["tp2", "pp2"])
def test_zenflow_with_model_parallelism_resumes_bit_for_bit(tmp_path, layout):
    """ZenFlow's checkpoint under ``--tp 2`` / ``--pp 2`` (private, a freezing schedule) holds the
    in-flight window at step 3 (interval 2: a window sum open, the last window's host result in
    flight) as one global selection per weight (``offload.checkpoint_form``): a run branched
    from it in the same layout gives the straight run's losses bit for bit, and one process
    resumes from it too (float32, rel 1e-5: another layout sums in another order); and the
    other way: that one process's checkpoint at step 4 (mid-window again) resumes in the layout,
    its last two losses within rel 1e-5 of the one process's."""
    two = [*ZENFLOW, *FREEZE, "--strategy", "zero3"]
    straight = _train(tmp_path, "straight", *two, "--nproc", "2", *layout, "--ckpt-dir", str(tmp_path / "ck"),
                      "--ckpt-every", "3")
    from_ck = ["--resume-from", str(tmp_path / "ck" / "step_3")]
    branch = _train(tmp_path, "branch", *two, "--nproc", "2", *layout, *from_ck)
    one = _train(tmp_path, "one", *two, *from_ck, "--ckpt-dir", str(tmp_path / "ck1"), "--ckpt-every", "4")
    assert len(straight) == 6 and branch == straight
    assert one[:3] == straight[:3] and one == pytest.approx(straight, rel=1e-5)
    back = _train(tmp_path, "back", *two, "--nproc", "2", *layout, "--resume-from", str(tmp_path / "ck1" / "step_4"))
    assert back[:4] == one[:4] and back == pytest.approx(one, rel=1e-5)
