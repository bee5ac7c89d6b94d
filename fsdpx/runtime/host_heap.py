"""Keep a step's reused host temporaries on mapped pages (glibc only).

A pipeline stage frees each microbatch's temporaries (activations, logits, their gradients; a few
MiB each) after its backward and allocates the same sizes again for the next microbatch. Under
glibc's defaults a block above the *mmap threshold* (128 KiB until the process frees a larger
mmapped block) is mapped on allocation and unmapped on free, and free space at the top of the
heap above the *trim threshold* is handed back to the kernel: either way the next microbatch
writes to fresh pages, one minor fault per 4 KiB (about 2 ms per 8 MiB here). How often that
happens depends on the process's allocation history, so one launch of the same step can be
several percent slower than the next.

glibc raises both thresholds by itself when a program frees a mapped block (mallopt(3),
"M_MMAP_THRESHOLD": the threshold becomes the freed block's size, at most 32 MiB on 64-bit, and
the trim threshold twice that), expecting blocks of that size to come back. ``raise_thresholds``
triggers that adjustment once, with one 32 MiB block: blocks up to 32 MiB then come from the
heap and up to 64 MiB of free heap stays mapped. Nothing is configured (no ``mallopt``): a
process that set the thresholds itself (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``mallopt``) has glibc's dynamic adjustment switched off, and this changes nothing there.
"""

from __future__ import annotations

import ctypes
import functools

_BLOCK = 32 * 1024 * 1024 - 64 * 1024  # under glibc's 32 MiB cap once its chunk header is added


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl, macOS: no such symbol)
    except (OSError, AttributeError):
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    return libc


def raise_thresholds() -> bool:
    """Allocate, touch nothing of, and free one 32 MiB block through glibc's ``malloc``, so its
    dynamic mmap threshold becomes 32 MiB and its trim threshold 64 MiB (where the process has
    not fixed them). Returns whether glibc was found. Idempotent: the thresholds only rise.
    No values change anywhere: allocation sizes and timing only
    (``tests/test_host_heap.py::test_raise_thresholds_keeps_reused_blocks_mapped``)."""
    libc = _glibc()
    if libc is None:
        return False
    block = libc.malloc(_BLOCK)
    if block:
        libc.free(block)
    return True
