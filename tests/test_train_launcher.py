"""Workers never outlive their launcher (issue 14): SIGKILL ``fsdpx train --nproc 2`` mid-run
and neither torchrun nor a worker survives, and nothing more is written to the run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpx.train.launch import LAUNCHER_PID, _alive, die_with_parent


def _started_by(launcher: int) -> list[int]:
    """Processes whose environment names ``launcher`` as their launcher (torchrun, workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{LAUNCHER_PID}={launcher}".encode() in env:
            found.append(int(entry.name))
    return found


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_die_with_parent_is_set_on_linux():
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    code = "from fsdpx.train.launch import die_with_parent; import sys; sys.exit(0 if die_with_parent() else 1)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_launcher_leaves_no_worker_and_no_write(tmp_path):
    out = tmp_path / "runs"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fsdpx", "train", "--strategy", "zero2", "--nproc", "2", "--steps", "100000",
         "--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000",
         "--batch-size", "16", "--noise-multiplier", "1", "--out", str(out), "--ckpt-dir", str(tmp_path / "ck"),
         "--ckpt-every", "2", "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "private" / "metrics.jsonl"
    children: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        children = _started_by(launcher.pid)
        assert len(children) >= 3  # torchrun and its two workers
        launcher.kill()
        launcher.wait()
        time.sleep(1.0)
        after_kill = _snapshot(tmp_path)
        # every child gone within 10 s (polled: a dead process writes nothing more), then the
        # files as they were 1 s after the kill, and still so 2 s later
        deadline = time.monotonic() + 10.0
        while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in children if _alive(pid)] == []
        assert _snapshot(tmp_path) == after_kill
        time.sleep(2.0)
        assert _snapshot(tmp_path) == after_kill
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in children:  # only what this test started, should it fail
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
