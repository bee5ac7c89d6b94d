"""``fsdpx jobs plan`` (``python -m fsdpx jobs``) and the jobs file (issue 13)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdpx.jobs.cli import main
from fsdpx.jobs.jobsfile import JobsFileError, parse_jobs

TINY = """
[[job]]
name = "{name}"
steps = 20
batch_size = 16
n_layer = 1
n_embd = 32
n_head = 2
corpus_chars = 4000
"""


def test_a_synthetic_plan_prints_its_table_and_writes_a_gantt_chart(tmp_path, capsys):
    fails = [a for j in range(6) for a in ("--fail", f"job0{j}@1")]  # some job runs at 1 s; the others are idle
    main(["plan", "--synthetic", "6", "--devices", "4", "--time-limit", "1", "--gantt", str(tmp_path / "g.png"),
          "--simulate", *fails])
    out = capsys.readouterr().out
    assert out.count("job0") >= 6 and "lower bound" in out and "re-plan at 1.0 s: job0" in out
    assert "steps lost to failures 0" not in out
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_the_jobs_file_is_parsed_into_gpt_tasks():
    tasks, cluster = parse_jobs("[cluster]\ndevices = 4\n" + TINY.format(name="a")
                                + TINY.format(name="b") + "privacy = { target_epsilon = 4.0 }\n")
    assert [t.name for t in tasks] == ["a", "b"] and cluster == {"devices": 4}
    assert tasks[1].privacy.target_epsilon == 4.0 and tasks[0].privacy is None and tasks[0].hparams["n_embd"] == 32
    with pytest.raises(JobsFileError, match="lacks"):
        parse_jobs('[[job]]\nname = "x"\nsteps = 3\n')
    with pytest.raises(JobsFileError, match="'x'.*not RunConfig fields"):
        parse_jobs('[[job]]\nname = "x"\nsteps = 3\nbatch_size = 4\nwidth = 3\n')
    with pytest.raises(JobsFileError, match="no \\[\\[job\\]\\]"):
        parse_jobs("")


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fsdpx", "jobs", *args], cwd=cwd, capture_output=True, text=True)


def test_bad_jobs_files_exit_2_before_anything_runs(tmp_path):
    (tmp_path / "dup.toml").write_text(TINY.format(name="a") + TINY.format(name="a"))
    r = run_cli("plan", "dup.toml", cwd=tmp_path)
    assert r.returncode == 2 and "repeated: ['a']" in r.stderr
    big = TINY.format(name="huge").replace("n_embd = 32", "n_embd = 1024").replace("n_layer = 1", "n_layer = 8")
    (tmp_path / "big.toml").write_text(TINY.format(name="fine") + big)
    r = run_cli("plan", "big.toml", "--devices", "4", "--memory-gib", "0.01", "--profiles", "prof", cwd=tmp_path)
    assert r.returncode == 2 and "['huge'] fit no technique" in r.stderr
    assert not (tmp_path / "prof").exists()  # nothing was profiled


@pytest.mark.slow
def test_a_jobs_file_is_profiled_for_real_and_planned(tmp_path):
    (tmp_path / "jobs.toml").write_text(TINY.format(name="solo"))
    r = run_cli("plan", "jobs.toml", "--devices", "4", "--techniques", "zero2", "--profile-counts", "1", "2",
                "--profiles", "prof", "--gantt", "plan.png", "--time-limit", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "solo / zero2: profiled on 1 and 2 devices" in r.stdout and "How far to trust it" in r.stdout
    assert "makespan" in r.stdout
    # issue 28: the minutes of profiling are not silent: what runs, then each profile as it ends
    assert "fsdpx jobs: profiling 2 of 2 (job, technique, device count)" in r.stderr
    assert sum(" solo / zero2 on " in line and " s a step, " in line for line in r.stderr.splitlines()) == 2
    assert len(list((tmp_path / "prof").iterdir())) == 2 and (tmp_path / "plan.png").exists()


USER_MODULE = '''
import torch
import torch.nn.functional as F
from torch import nn


def model(h):
    return nn.Sequential(nn.Linear(4, h["hidden"]), nn.Tanh(), nn.Linear(h["hidden"], 2))


def points(h):
    x = torch.randn(h["n"], 4)
    return x, (x[:, 0] > 0).long()


def loss(out, y):
    return F.cross_entropy(out, y, reduction="none")
'''

USER_JOB = """
[[job]]
name = "{name}"
model_fn = "{module}:model"
data_fn = "{module}:points"
loss_fn = "{module}:loss"
steps = 4
batch_size = 16
hparams = {{ hidden = 8, n = 256, lr = 0.05 }}
"""


def user_jobs_dir(tmp_path, module: str, extra: str = "") -> "Path":
    """A folder holding a user's module and a jobs file naming its functions."""
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / f"{module}.py").write_text(USER_MODULE)
    (lab / "jobs.toml").write_text(USER_JOB.format(name="mlp", module=module) + extra)
    return lab


def test_a_jobs_file_names_a_users_functions_importable_from_beside_it(tmp_path):
    """A ``[[job]]`` with ``model_fn``/``data_fn``/``loss_fn`` is the user's Task: its functions
    are the module's (imported from the file's folder), ``hparams`` its table; beside it a GPT job."""
    from fsdpx.jobs.jobsfile import read_jobs
    from fsdpx.jobs.train_run import function_refs

    lab = user_jobs_dir(tmp_path, "userlab_a", TINY.format(name="gpt") + "privacy = { target_epsilon = 4.0 }\n")
    tasks, _ = read_jobs(lab / "jobs.toml")
    mlp, gpt = tasks
    assert mlp.model_fn is sys.modules["userlab_a"].model and mlp.loss_fn is sys.modules["userlab_a"].loss
    assert mlp.hparams == {"hidden": 8, "n": 256, "lr": 0.05} and mlp.privacy is None and mlp.steps == 4
    assert function_refs(mlp)["model_fn"] == "userlab_a:model"
    assert gpt.privacy.target_epsilon == 4.0 and gpt.hparams["n_embd"] == 32


@pytest.mark.parametrize("change, match", [
    (('loss_fn = "userlab_b:loss"\n', ""), "lacks \\['loss_fn'\\]"),
    (('"userlab_b:points"', '"userlab_b:nowhere"'), "'mlp'.*has no nowhere"),
    (('"userlab_b:points"', '"no_such_module_xyz:points"'), "'mlp'.*does not import"),
    (("hparams", "width = 3\nhparams"), "'mlp': unknown keys \\['width'\\]"),
])
def test_a_user_job_that_cannot_be_built_is_named(tmp_path, change, match):
    from fsdpx.jobs.jobsfile import read_jobs

    lab = user_jobs_dir(tmp_path, "userlab_b")
    path = lab / "jobs.toml"
    path.write_text(path.read_text().replace(*change))
    with pytest.raises(JobsFileError, match=match):
        read_jobs(path)


@pytest.mark.slow
def test_a_users_jobs_file_runs_from_the_command_line(tmp_path):
    """``fsdpx jobs run`` on a file naming a user's functions, from another folder: profiled,
    planned and trained by torchrun workers that import the module from the file's folder."""
    lab = user_jobs_dir(tmp_path, "userlab_c")
    r = run_cli("run", str(lab / "jobs.toml"), "--devices", "1", "--techniques", "ddp", "--profile-counts", "1",
                "--profiles", "prof", "--out", "out", "--gantt", "plan.png", "--time-limit", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    metrics = (tmp_path / "out" / "mlp" / "run").rglob("metrics.jsonl")
    assert [len(p.read_text().splitlines()) for p in metrics] == [4]
