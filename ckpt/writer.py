"""Write one rank's shard file: the blocks this rank is the first replica of, in the
safetensors layout, hashed while written, then fsynced.

File layout (readable by ``safetensors.safe_open``, proved by ``tests/test_ckpt_save_load.py::
test_shard_files_open_with_safetensors``)::

    u64 little-endian N | N bytes of JSON header, space-padded to a multiple of 8 | data

The header maps each tensor path to ``{"dtype", "shape" (local), "data_offsets"}``; blocks are
stored back to back, C-contiguous, little-endian, in the order given. The manifest records the
ABSOLUTE offset (``8 + N + data_offsets[0]``) so readers never parse the header.

Each block is hashed while ``os.write`` copies it (the write runs in a helper thread and releases
the GIL), so checksums cost no extra time when writing is the bottleneck. Writeback of every
64 MiB chunk is started as soon as it is written (``sync_file_range``), so the final ``fsync``
waits only for the tail instead of the whole file.

Guarantees: the returned ``FileResult`` checksum is ``checksum.shard_checksum`` of the header
and the block digests, over the very bytes written (``ckpt.verify`` recomputes it from the file);
every block gets its own checksum; the file is
created with ``O_EXCL`` (never overwritten) and is durable (fsynced) when this returns. A write
error (e.g. ``EFBIG``/``ENOSPC``) propagates as the ``OSError``; the caller discards the
temporary directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import format as fmt
from .checksum import hex_digest, shard_checksum

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("ckpt writes raw little-endian bytes and needs a little-endian host")

_CHUNK = 64 << 20  # bytes per write(2); writeback of each chunk starts as soon as it is written


def _libc_sync_file_range():
    """``sync_file_range(2)`` from the C library, or ``None`` where it does not exist."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range() if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk now,
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk works while
    the next chunk is copied; elsewhere a no-op. Durability still comes from the final
    ``fsync``: this only moves the flush earlier."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: errors surface at fsync


@dataclass(frozen=True)
class Stored:
    """Where one block landed: absolute byte offset, length, block checksum."""

    offset: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class FileResult:
    size: int
    checksum: str
    stored: dict[str, Stored]


def file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def as_bytes(t: Tensor) -> memoryview:
    """The raw bytes of a CPU tensor as a flat ``memoryview`` (a view when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def header(blocks: list[tuple[str, Tensor]]) -> bytes:
    """The safetensors header (length prefix included) for ``blocks`` stored back to back."""
    entries, pos = {}, 0
    for path, t in blocks:
        n = t.numel() * t.element_size()
        entries[path] = {"dtype": fmt.DTYPES[t.dtype][1], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    entries["__metadata__"] = {"format": "pt", "writer": "fsdpx.ckpt"}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at the file position (which is ``offset``), chunk by chunk, starting each
    chunk's writeback once it is in the page cache."""
    while len(data):
        n = os.write(fd, data[:_CHUNK])
        start_writeback(fd, offset, n)
        offset += n
        data = data[n:]


def write_shard(path: Path, blocks: list[tuple[str, Tensor]]) -> FileResult:
    """Create ``path`` (must not exist), write ``blocks`` and fsync it."""
    for name, t in blocks:
        fmt.dtype_name(t.dtype)  # refuse unsupported dtypes before creating anything
    head = header(blocks)
    stored, pos = {}, len(head)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-write") as pool:
            _write_all(fd, memoryview(head), 0)
            for name, t in blocks:
                data = as_bytes(t)
                written = pool.submit(_write_all, fd, data, pos)
                digest = hex_digest(data)  # overlaps the write
                written.result()
                stored[name] = Stored(pos, len(data), digest)
                pos += len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileResult(pos, shard_checksum(head, [b.checksum for b in stored.values()]), stored)
