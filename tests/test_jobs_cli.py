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
    assert "solo / zero2: profiled [1, 2]" in r.stdout and "makespan" in r.stdout
    assert len(list((tmp_path / "prof").iterdir())) == 2 and (tmp_path / "plan.png").exists()
