"""A full disk (``RLIMIT_FSIZE`` in a subprocess): the save raises, nothing is lost, training
goes on."""

import json
import subprocess
import sys

import ckpt
from fsdpx import Mesh

from support.processes import python_env


def test_full_disk_raises_and_keeps_earlier_checkpoints(tmp_path):
    run = subprocess.run([sys.executable, "-m", "support.ckpt_worker", "fsize", str(tmp_path), str(64 << 10)],
                         capture_output=True, text=True, timeout=120, env=python_env())
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"small": "ok", "big_blocking": "OSError: errno 27", "big_async": "OSError: errno 27", "after": "ok"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_4"]  # no leftovers of 2 and 3
    for step in (1, 4):
        ckpt.verify(tmp_path / f"step_{step}")
    assert ckpt.load(tmp_path / "step_1", mesh=Mesh(), strategy=None)["step"] == 1
