"""``fsdpx.runtime.host_heap.raise_thresholds``: reused host blocks stay mapped, user settings win.

What a process's heap does *without* the call depends on its allocation history (and on the
machine: CI's default kept most pages mapped where this one faults every page in again), so the
tests assert the mechanism and the outcome after the call, never the default's behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = 4 * 8 * 1024 * 1024 / 4096  # one round's pages: four 8 MiB tensors

_PRELUDE = """
import ctypes, resource, sys, torch
from fsdpx.runtime.host_heap import raise_thresholds
if sys.argv[1] == "raise":
    assert raise_thresholds()
"""

# four 8 MiB tensors written and freed, ten times: minor faults per round
_FAULTS = _PRELUDE + """
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

# how many mapped (mmap) blocks one 16 MiB malloc adds: 0 when it comes from the heap
_MAPPED = _PRELUDE + """
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
h0 = libc.mallinfo2().hblks
block = libc.malloc(16 * 1024 * 1024)
print(libc.mallinfo2().hblks - h0)
libc.free(block)
"""


def _run(script: str, mode: str, **env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


@linux_only
def test_raise_thresholds_serves_a_16_mib_block_from_the_heap():
    # glibc's starting mmap threshold is 128 KiB: without the raise a fresh process maps the block
    assert _run(_MAPPED, "raise") == 0


@linux_only
def test_raise_thresholds_keeps_reused_blocks_mapped():
    assert _run(_FAULTS, "raise") < 0.1 * PAGES  # the blocks come back from the mapped heap


@linux_only
def test_a_process_that_set_its_malloc_thresholds_keeps_them():
    # MALLOC_MMAP_THRESHOLD_ switches glibc's dynamic adjustment off: every 8 MiB block is mapped
    # and unmapped, raise_thresholds or not (the memory benchmarks rely on it)
    fixed = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    assert _run(_MAPPED, "raise", **fixed) == 1
    assert _run(_FAULTS, "raise", **fixed) > 0.8 * PAGES
