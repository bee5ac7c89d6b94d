"""``privacy.host_pages.keep_freed_pages``: once a private step is made, the blocks a step frees
come back without page faults; a malloc the environment configures is left alone.

As in ``tests/test_host_heap.py``, the default's behaviour depends on the process's allocation
history, so the tests assert the outcome after the call, never the default's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# one round's pages: twelve 8 MiB tensors (96 MiB, over glibc's 64 MiB trim cap) and one of 64 MiB (over its
# 32 MiB mmap cap: the logits' size on the benchmark's small models)
PAGES = (12 * 8 + 64) * 1024 * 1024 / 4096

# a private step is made (that is what applies the setting), then twelve 8 MiB tensors and one
# of 64 MiB are written and freed, ten times: the minor faults per round, and what the call answered
_SCRIPT = """
import resource, torch
from torch import nn
from fsdpx.optim import adamw
from privacy.host_pages import keep_freed_pages
from privacy.step import DPConfig, make_private_step
make_private_step(nn.Linear(2, 2), lambda out, y: (out - y).pow(2).sum(1), adamw(1e-3),
                  DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5), num_examples=4)
def round_():
    xs = [torch.ones(2 * 1024 * 1024) for _ in range(12)] + [torch.ones(16 * 1024 * 1024)]
    del xs
round_()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(keep_freed_pages(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10)
"""


def _run(**env: str) -> tuple[bool, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    applied, faults = out.stdout.strip().splitlines()[-1].split()
    return applied == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_after_a_private_step_is_made_freed_blocks_come_back_without_page_faults():
    applied, faults = _run()
    assert applied
    assert faults < 0.05 * PAGES, faults  # every page of a round would be ~40960 faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_configured_malloc_is_left_alone():
    """With ``MALLOC_MMAP_THRESHOLD_=65536`` (how the memory benchmarks run) nothing is set: the
    blocks stay mapped on their own and fault every page in again, round after round."""
    applied, faults = _run(MALLOC_MMAP_THRESHOLD_="65536")
    assert not applied
    assert faults > 0.9 * PAGES, faults
