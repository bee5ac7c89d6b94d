"""``fsdpx train`` end to end on a tiny model: the files it writes, and how it rejects bad flags."""

import json
import math
import runpy
import sys

import pytest
import torch

from fsdpx.train import cli, loop, report
from fsdpx.train import ConfigError, RunConfig
from privacy.errors import PrivacyError

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-chars", "20000",
        "--no-progress"]
METRIC_KEYS = {"step", "loss", "epsilon", "batch_size", "clipped_fraction", "mean_norm", "step_seconds",
               "elapsed_seconds"}
CLOCKS = ("step_seconds", "elapsed_seconds")  # wall time: differs from run to run
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models are fastest on one thread, and on a busy machine a second one mostly waits.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _train(tmp_path, *flags):
    cli.main(["train", "--out", str(tmp_path), *TINY, *flags])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_private_run_writes_metrics_plot_config_and_summary(tmp_path, capsys):
    _train(tmp_path, "--steps", "5", "--name", "tiny", "--batch-size", "16", "--target-epsilon", "4")
    run_dir = tmp_path / "tiny"
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(set(r) == METRIC_KEYS for r in rows)
    epsilons = [r["epsilon"] for r in rows]
    assert all(math.isfinite(e) for e in epsilons)
    assert all(a < b for a, b in zip(epsilons, epsilons[1:]))
    assert epsilons[-1] <= 4.0
    assert all(math.isfinite(r["loss"]) and 0 <= r["clipped_fraction"] <= 1 and r["mean_norm"] > 0 for r in rows)
    assert METRIC_KEYS <= set(loop.METRICS)  # the documented keys
    assert all(r["step_seconds"] > 0 for r in rows)
    assert [r["elapsed_seconds"] for r in rows] == sorted(r["elapsed_seconds"] for r in rows)
    # each step's seconds add up to the time since the loop began (float sums: within rounding)
    assert [r["elapsed_seconds"] for r in rows] == pytest.approx(
        [sum(q["step_seconds"] for q in rows[:i + 1]) for i in range(len(rows))], rel=1e-9)
    assert (run_dir / "plot.png").read_bytes()[:8] == PNG_MAGIC
    config = json.loads((run_dir / "config.json").read_text())
    assert config["run"]["steps"] == 5 and config["privacy"]["private"] is True
    assert config["derived"]["noise_multiplier"] > 0
    out = capsys.readouterr().out
    assert f"epsilon {epsilons[-1]:.3f} at delta 1e-05" in out and str(run_dir) in out


def test_a_run_is_a_function_of_its_flags(tmp_path):
    for name in ("a", "b"):
        _train(tmp_path, "--steps", "3", "--name", name, "--batch-size", "16", "--noise-multiplier", "1")
    drop_time = [{k: v for k, v in r.items() if k not in CLOCKS} for r in _metrics(tmp_path / "a")]
    assert drop_time == [{k: v for k, v in r.items() if k not in CLOCKS} for r in _metrics(tmp_path / "b")]


def test_run_config_keeps_only_the_fields_it_uses():
    assert RunConfig().privacy.target_epsilon == 8.0 and RunConfig().privacy.noise_multiplier is None
    assert RunConfig.of(noise_multiplier=1.0).privacy.target_epsilon is None
    assert RunConfig.of(sample_rate=0.1).privacy.batch_size is None
    plain = RunConfig.of(private=False, noise_multiplier=1.0).privacy
    assert plain.target_epsilon is None and plain.noise_multiplier is None
    with pytest.raises(ConfigError, match="target_epsilon or noise_multiplier"):
        RunConfig.of(target_epsilon=None)


def test_non_private_run_has_no_epsilon(tmp_path, capsys):
    _train(tmp_path, "--steps", "3", "--batch-size", "16", "--non-private")
    rows = _metrics(tmp_path / "non-private")
    assert len(rows) == 3
    assert all(r["epsilon"] is None and r["mean_norm"] is None and math.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "non-private" / "plot.png").read_bytes()[:8] == PNG_MAGIC
    assert "non-private: no guarantee" in capsys.readouterr().out


def test_epsilon_budget_stops_the_run_before_the_step_that_would_exceed_it(tmp_path, capsys):
    _train(tmp_path, "--steps", "50", "--name", "budget", "--corpus-chars", "20000", "--sample-rate", "0.05",
           "--noise-multiplier", "1", "--epsilon-budget", "1.5")
    rows = _metrics(tmp_path / "budget")
    assert 0 < len(rows) < 50 and rows[-1]["epsilon"] <= 1.5
    assert "stopped early: privacy budget exhausted" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["--steps", "x"], "argument --steps: invalid integer value: 'x'"),
        (["--delta", "1"], "argument --delta: must be in (0, 1), got 1"),
        (["--target-epsilon", "1", "--noise-multiplier", "1"], "not allowed with argument"),
        (["--non-private", "--target-epsilon", "1"], "not allowed with argument"),
        (["--batch-size", "8", "--sample-rate", "0.1"], "not allowed with argument"),
        (["--method", "magic"], "invalid choice: 'magic'"),
        (["--n-embd", "30", "--n-head", "4"], "--n-embd=30 must be divisible by --n-head=4"),
        (["--batch-size", "1e9"], "larger than the dataset"),
    ],
)
def test_bad_flags_exit_2_with_a_message(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--out", str(tmp_path), "--no-progress", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fsdpx train: error:" in err and message in err


def test_privacy_errors_exit_2_without_a_traceback(tmp_path, capsys, monkeypatch):
    def refuse(config, progress, comm=None):
        raise PrivacyError("sample_rate must be in (0, 1], got sample_rate=2.0")

    monkeypatch.setattr(cli, "run", refuse)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fsdpx train: error: sample_rate must be in (0, 1]" in err and "Traceback" not in err


def test_python_dash_m_fsdpx_runs_the_cli(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fsdpx", "train", "--steps", "0"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fsdpx", run_name="__main__")
    assert exit_info.value.code == 2
    assert "--steps: must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_sharded_main_job_on_two_gloo_processes(tmp_path):
    """``fsdpx train --strategy zero3 --nproc 2`` launches torchrun and trains privately."""
    import json
    import subprocess
    import sys

    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "fsdpx", "train", "--strategy", "zero3", "--nproc", "2",
                           "--steps", "3", "--corpus-chars", "20000", "--batch-size", "32", "--n-embd", "16",
                           "--n-head", "2", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zero3 on Mesh(dp=2)" in done.stderr
    records = [json.loads(line) for line in (out / "private" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["comm_bytes"]["all_gather"] > 0 and records[-1]["comm_bytes"]["reduce_scatter"] > 0
    assert 0 < records[-1]["epsilon"] < 8.5
    assert (out / "private" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_progress_bar_says_what_its_loss_is(tmp_path, capsys):
    """Issue 28: the bar said ``loss=`` for a 10-step running mean. It now names it, and the
    count of steps it averages (fewer than 10 at the start)."""
    flags = [f for f in TINY if f != "--no-progress"]
    cli.main(["train", "--out", str(tmp_path), *flags, "--steps", "3", "--batch-size", "16", "--non-private"])
    err = capsys.readouterr().err
    losses = [r["loss"] for r in _metrics(tmp_path / "non-private")]
    assert f"loss {sum(losses) / 3:.3f} (mean of last 3 steps), non-private" in err
    assert "loss=" not in err
    rows = [{"loss": 2.0, "epsilon": 0.5}, {"loss": 4.0, "epsilon": 1.25}]
    assert report.bar_text(rows) == "loss 3.000 (mean of last 2 steps), epsilon 1.25"
    assert report.bar_text(rows[:1] * 12) == f"loss 2.000 (mean of last {report.SMOOTHING} steps), epsilon 0.50"


@pytest.mark.parametrize("flags, words", [
    (["--offload", "zenflow", "--offload-topk", "0.25"], "ZenFlow offload (the top 25% of columns each step, the rest"
                                                         " on the host every 4 steps)"),
    (["--offload", "zero"], "ZeRO-Offload (the optimizer on the host)"),
])
def test_the_run_header_names_the_offload(tmp_path, capsys, flags, words):
    """Issue 28: the run's header line left ``--offload`` out."""
    _train(tmp_path, "--steps", "1", "--batch-size", "16", "--non-private", *flags)
    header = capsys.readouterr().err.splitlines()[0]
    assert header.startswith("fsdpx train: 1 steps") and words in header


def test_nproc_without_strategy_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--nproc", "2"])
    assert exit_.value.code == 2
    assert "--nproc needs --strategy" in capsys.readouterr().err


PARALLEL = {  # flags (with --strategy zero3) -> the mesh the run must report
    "tp2_sp_dp2": (["--tp", "2", "--sequence-parallel", "--nproc", "4"], "Mesh(dp=2, tp=2)"),
    "pp2": (["--pp", "2", "--nproc", "2", "--schedule", "zero_bubble", "--microbatches", "3"], "Mesh(pp=2, dp=1)"),
    "dp2_tp2_pp2": (["--pp", "2", "--tp", "2", "--nproc", "8", "--schedule", "1f1b", "--microbatches", "4"],
                    "Mesh(pp=2, dp=2, tp=2)"),
}


PARALLEL_FLAGS = ["--steps", "3", "--corpus-chars", "20000", "--batch-size", "32", "--n-embd", "16", "--n-head", "2",
                  "--no-progress"]


def _fsdpx_run(out, *extra):
    """``python -m fsdpx train PARALLEL_FLAGS EXTRA --out OUT``: its stderr, and each step's loss and
    batch size."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "fsdpx", "train", *PARALLEL_FLAGS, *extra, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "private" / "metrics.jsonl").read_text().splitlines()]
    return done.stderr, [r["loss"] for r in records], [r["batch_size"] for r in records]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The one-process run every parallel layout must follow: the same flags, run once for all."""
    return _fsdpx_run(tmp_path_factory.mktemp("one"))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PARALLEL))
def test_a_parallel_main_job_follows_the_single_process_run(tmp_path, case, one_process_run):
    """``fsdpx train --strategy zero3`` with tensor parallelism and sequence parallelism on 4
    processes, a pipeline alone on 2 (zero-bubble), and the full 3-D ``--pp 2 --tp 2`` on 8
    (1F1B): the same batches and noise as one process, so the same losses (float32, rel 1e-5)
    and batch sizes at every step (issue 28: under --tp 2, batch_size was twice the batch). The
    one-process run is the same command for every case, run once (``one_process_run``)."""
    parallel, mesh = PARALLEL[case]
    stderr, losses, batches = _fsdpx_run(tmp_path / "parallel", *parallel, "--strategy", "zero3")
    assert f"zero3 on {mesh}" in stderr
    _, one_losses, one_batches = one_process_run
    assert losses == pytest.approx(one_losses, rel=1e-5)
    assert batches == one_batches


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2"], "error: --pp needs a strategy"),
    (["--pp", "3", "--strategy", "zero3", "--nproc", "4", "--n-layer", "3"], "--tp=1 x --pp=3 does not divide the 4"),
    (["--pp", "2", "--virtual-stages", "2", "--strategy", "zero3"], "--virtual-stages=2 needs an interleaved kind"),
    (["--pp", "2", "--virtual-stages", "2", "--strategy", "zero3", "--schedule", "interleaved_1f1b"],
     "4 pipeline stages but only 2 blocks: every stage needs a block"),
    (["--pp", "2", "--strategy", "zero3", "--schedule", "interleaved_1f1b", "--n-layer", "4", "--virtual-stages",
      "2", "--microbatches", "3"], "multiple"),
    (["--tp", "2"], "error: --tp needs a strategy"),
    (["--tp", "3", "--strategy", "zero3", "--nproc", "4", "--n-head", "3", "--n-embd", "12"],
     "--tp=3 x --pp=1 does not divide the 4 processes"),
    (["--tp", "2", "--strategy", "zero3", "--n-head", "3", "--n-embd", "12"], "--n-head=3 does not divide by --tp=2"),
    (["--sequence-parallel", "--strategy", "zero3"], "--sequence-parallel needs --tp > 1"),
])
def test_parallelism_flags_that_cannot_work_are_refused(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_your_own_package_imports_from_the_directory_you_run_in(tmp_path):
    """``fsdpx train --model python --model-fn mylab.jobs:model ...`` from the directory holding
    ``mylab/`` works from the ``fsdpx`` script as from ``python -m fsdpx``, without PYTHONPATH."""
    import inspect
    import os
    import subprocess
    from pathlib import Path

    from support import mlp_job

    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "jobs.py").write_text(inspect.getsource(mlp_job).split("def mlp_task")[0]
                                                .replace("import fsdpx.jobs as jobs\n", ""))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = Path(sys.executable).parent / "fsdpx"
    argv = ["train", "--model", "python", "--model-fn", "mylab.jobs:mlp", "--data-fn", "mylab.jobs:blobs",
            "--loss-fn", "mylab.jobs:cross_entropy", "--hparams", "d_in = 8, hidden = 4, classes = 3, n = 64",
            "--steps", "2", "--batch-size", "16", "--non-private", "--no-progress", "--out", str(tmp_path / "runs")]
    for name, cmd in [("script", [str(script)]), ("module", [sys.executable, "-m", "fsdpx"])]:
        done = subprocess.run([*cmd, *argv, "--name", name], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len((tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("argv, says", [
    (["train", "--stepz", "3"], "fsdpx train: error: unknown flag --stepz (did you mean --steps?)"),
    (["train", "--resume-f", "x"], "fsdpx train: error: unknown flag --resume-f (did you mean --resume-from?)"),
    (["train", "--steps", "x"], "fsdpx train: error: argument --steps: invalid integer value: 'x'"),
    (["train", "extra"], "fsdpx train: error: unexpected argument 'extra'"),
    (["jobs", "plan", "--devics", "3"], "fsdpx jobs plan: error: unknown flag --devics (did you mean --devices?)"),
    (["schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--virt", "2"],
     "fsdpx schedule: error: unknown flag --virt (did you mean --virtual?)"),
    (["export", "ckpt", "--to", "out", "--overwrit"], "fsdpx export: error: unknown flag --overwrit"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_mistyped_flag_is_one_line_naming_it(tmp_path, capsys, argv, says):
    """Every command refuses a flag it does not know (or an abbreviation of one) with one line
    naming it and the closest real flag, exit 2, before anything runs or is written."""
    from fsdpx import cli as front

    with pytest.raises(SystemExit) as exit_info:
        front.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(says), err
    assert "--help lists the flags" in err and "usage:" not in err
