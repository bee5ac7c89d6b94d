"""Keep the host pages a private step frees mapped for its next step (glibc only).

A ghost-clipped step frees, at its end, every example's instantiated weight gradients (for the
benchmark's small GPTs about 200 MiB, in blocks of 4-13 MiB) on top of the activations a
non-private step frees too. glibc hands free space at the top of its heap back to the kernel
once it passes the *trim threshold* (at most 64 MiB under glibc's own dynamic adjustment:
:mod:`fsdpx.runtime.host_heap`), and maps every block above the *mmap threshold* on its own, so
the next step writes to fresh pages: one minor fault per 4 KiB. On the small plain GPT at one
thread that was about 105k faults a step against the non-private step's 33k, 0.13-0.19 s more
kernel time in a 1.2 s step (``docs/performance.md``, "Private step").

:func:`keep_freed_pages` sets glibc's mmap threshold to 32 MiB (its maximum on 64-bit), its trim
threshold to 1 GiB, and the number of blocks it may map on their own to 0, so every block comes
from the heap, and a step reuses the pages the last one freed. The last matters for the blocks
over 32 MiB, which glibc would otherwise map on their own whenever its free heap has no room for
them: the logits and their gradients (64 MiB on the small models). The ghost step's tape faulted
in 33k pages a step that way (the non-private step 16k; the tape keeps the LM head's output
gradient for its per-example products); with no block mapped on its own, none
(``docs/performance.md``, "Private step"). The same blocks are live at the same time, so the
peak does not grow beyond what the heap's fragmentation costs; what changes is that up to 1 GiB
of free heap stays resident between steps, and freed blocks below the heap's top are kept
(glibc trims only its top). A process that configures malloc itself (any ``MALLOC_*_`` variable,
or ``GLIBC_TUNABLES``) is left alone, as is one whose C library is not glibc. Nothing but
allocation changes: no value anywhere depends on it.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's <malloc.h>
MMAP_MAX = 0  # blocks glibc may map on their own: none, every block comes from the heap
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30


def user_configured(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the environment configures glibc's malloc (``MALLOC_*_`` or ``GLIBC_TUNABLES``):
    then :func:`keep_freed_pages` changes nothing (the memory benchmarks set
    ``MALLOC_MMAP_THRESHOLD_`` to see what a runtime frees)."""
    return "GLIBC_TUNABLES" in environ or any(k.startswith("MALLOC_") and k.endswith("_") for k in environ)


@functools.lru_cache(maxsize=1)
def keep_freed_pages() -> bool:
    """Set glibc's mmap threshold to 32 MiB, its trim threshold to 1 GiB and its count of blocks
    mapped on their own to 0, once per process (later calls return the first answer). Returns
    whether they were set: False where the environment configures malloc
    (:func:`user_configured`) or the C library is not glibc.

    Guarantee: afterwards, blocks that a step frees (those over 32 MiB too) are reused by the next
    step without a page fault (``tests/test_host_pages.py::
    test_after_a_private_step_is_made_freed_blocks_come_back_without_page_faults``); the
    environment's settings win (``test_a_configured_malloc_is_left_alone``)."""
    if user_configured():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl, macOS: no such symbol)
    except (OSError, AttributeError):
        return False
    libc.mallopt.restype, libc.mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    # the mmap threshold first: setting either switches glibc's dynamic adjustment off
    return (bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            and bool(libc.mallopt(M_MMAP_MAX, MMAP_MAX)))
