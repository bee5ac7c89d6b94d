"""``fsdpx.runtime.host_heap.raise_thresholds``: reused host blocks stay mapped, user settings win."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# four 8 MiB tensors written and freed, ten times: under glibc's defaults (trim threshold 16 MiB
# once an 8 MiB mapped block was freed) the free heap top is handed back each round and the next
# round faults its pages in again
_SCRIPT = """
import resource, sys, torch
from fsdpx.runtime.host_heap import raise_thresholds
if sys.argv[1] == "raise":
    assert raise_thresholds()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def round_():
    xs = [torch.ones(2 * 1024 * 1024) for _ in range(4)]
    del xs
round_()
f0 = faults()
for _ in range(10):
    round_()
print((faults() - f0) / 10)
"""


def _faults_per_round(mode: str, **env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_raise_thresholds_keeps_reused_blocks_mapped():
    pages = 4 * 8 * 1024 * 1024 / 4096  # one round's pages
    before = _faults_per_round("plain")
    after = _faults_per_round("raise")
    assert before > 0.8 * pages, before  # the default: every round faults its pages in again
    assert after < 0.1 * pages, after  # raised: the blocks come back from the mapped heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_process_that_set_its_malloc_thresholds_keeps_them():
    pages = 4 * 8 * 1024 * 1024 / 4096
    # MALLOC_MMAP_THRESHOLD_ switches glibc's dynamic adjustment off: every 8 MiB block is mapped
    # and unmapped, raise_thresholds or not (the memory benchmarks rely on it)
    assert _faults_per_round("raise", MALLOC_MMAP_THRESHOLD_="65536") > 0.8 * pages
