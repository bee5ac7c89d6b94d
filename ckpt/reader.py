"""Read one target box of a tensor from the stored boxes that overlap it, byte range by byte
range (``os.preadv`` straight into the destination's memory where the layout allows).

Two ways to read: a stored box read whole (or in one run) is ``preadv``-ed into its destination;
a box read in many runs (e.g. a column slice of a row-major block) is copied out of a read-only
``mmap`` of the file in one strided copy, touching exactly the runs' bytes, instead of one
system call per run; when those runs touch every page of their span, the span is first faulted
in with one ``MADV_POPULATE_READ`` (Linux 5.14+), which reads ahead in large requests. Either
way the kernel moves whole pages: rows shorter than a page cost their page on a cold cache,
whoever reads them.

Guarantees (``tests/test_ckpt_boxes.py``, ``property_tests/test_ckpt_properties.py``):
  * The result equals the global tensor's ``box`` bit for bit.
  * Only the bytes of the intersections are read: ``stats.bytes_read == stats.bytes_needed``
    for data (the manifest is counted apart, in ``metadata_bytes``).
  * A stored box read whole is checked against its xxh3 (``ChecksumMismatchError`` naming the
    file); a box read in part is not (its checksum covers bytes not read): ``ckpt.verify``
    checks whole files. A short read raises ``TruncatedShardError`` naming the file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .boxes import Box, extents, intersect, runs
from .checksum import hex_digest
from .errors import ChecksumMismatchError, TruncatedShardError
from .format import BoxRecord, TensorRecord, dtype_of, itemsize
from .writer import as_bytes


@dataclass
class ReadStats:
    """Bytes a rank read, for the read-amplification checks. ``bytes_needed`` counts the
    target boxes (what the rank holds after loading); ``bytes_read`` what ``pread`` returned."""

    bytes_read: int = 0
    bytes_needed: int = 0
    reads: int = 0
    metadata_bytes: int = 0
    boxes_verified: int = 0


def pread_into(fd: int, view: memoryview, offset: int, path: Path, stats: ReadStats) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; EOF first is a ``TruncatedShardError``."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        stats.reads += 1
        if n == 0:
            raise TruncatedShardError(str(path), f"ends before byte {offset + len(view)}")
        stats.bytes_read += n
        view, offset = view[n:], offset + n


MANY_RUNS = 8  # above this many runs, one strided copy from a mapping beats one syscall per run


class Files:
    """The shard files one load opens, each once: a descriptor and, on demand, a mapping."""

    def __init__(self, directory: Path, sizes: dict[str, int]) -> None:
        self.directory, self.sizes = directory, sizes
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}

    def path(self, name: str) -> Path:
        return self.directory / name

    def fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = os.open(self.path(name), os.O_RDONLY)
        return self._fds[name]

    def mapping(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            size = os.fstat(self.fd(name)).st_size
            if size != self.sizes[name]:  # reading a mapping past EOF would be a SIGBUS, not an error
                raise TruncatedShardError(str(self.path(name)), f"has {size} bytes, the manifest recorded {self.sizes[name]}")
            self._maps[name] = mmap.mmap(self.fd(name), 0, access=mmap.ACCESS_READ)
        return self._maps[name]

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        for fd in self._fds.values():
            os.close(fd)


def _byte_rows(flat: np.ndarray, ext: tuple[int, ...], size: int) -> np.ndarray:
    """A flat uint8 C-contiguous block seen with its shape, the last dim widened to bytes."""
    return flat.reshape(ext[:-1] + (ext[-1] * size,))


def _byte_slices(inter: Box, origin: Box, size: int) -> tuple[slice, ...]:
    last = len(inter) - 1
    return tuple(slice((s - o) * (size if d == last else 1), (e - o) * (size if d == last else 1))
                 for d, ((s, e), (o, _)) in enumerate(zip(inter, origin)))


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python 3.11 lacks the name
_PAGE = mmap.PAGESIZE


def _covers_every_page(offsets: np.ndarray, length: int) -> bool:
    """True if the runs ``[o, o + length)`` (sorted) leave no whole page untouched between the
    first and the last: then faulting the pages in bulk reads nothing the copy would not."""
    first, last = offsets // _PAGE, (offsets + length - 1) // _PAGE
    return bool(np.all(first[1:] <= last[:-1] + 1))


def _populate(mapping: mmap.mmap, start: int, stop: int) -> None:
    """Fault ``[start, stop)`` of the mapping in with one call (the kernel reads ahead in large
    requests, instead of one page fault at a time); a no-op where the kernel lacks it."""
    start -= start % _PAGE
    try:
        mapping.madvise(_MADV_POPULATE_READ, start, stop - start)
    except (OSError, ValueError):
        pass


def _strided_copy(files: Files, stored: BoxRecord, inter: Box, want: Box, out: Tensor, size: int,
                  stats: ReadStats, offsets: np.ndarray, length: int) -> None:
    """Copy ``inter`` from a stored box into ``out`` (holding ``want``) through a mapping.
    When the runs touch every page of their span anyway, the span is faulted in first in bulk."""
    if _covers_every_page(offsets, length):
        _populate(files.mapping(stored.file), stored.offset + int(offsets[0]), stored.offset + int(offsets[-1]) + length)
    flat = np.frombuffer(files.mapping(stored.file), dtype=np.uint8, count=stored.nbytes, offset=stored.offset)
    src = _byte_rows(flat, extents(stored.box), size)[_byte_slices(inter, stored.box, size)]
    dst = _byte_rows(out.reshape(-1).view(torch.uint8).numpy(), extents(want), size)
    np.copyto(dst[_byte_slices(inter, want, size)], src)
    stats.bytes_read += src.size
    stats.reads += 1


def read_box(record: TensorRecord, want: Box, files: Files, stats: ReadStats, *, verify: bool = True) -> Tensor:
    """The block ``want`` of the tensor described by ``record``, as a new CPU tensor."""
    dtype, size = dtype_of(record.dtype), itemsize(record.dtype)
    out = torch.empty(extents(want), dtype=dtype)
    stats.bytes_needed += out.numel() * size
    if out.numel() == 0:
        return out
    for stored in record.boxes:
        inter = intersect(stored.box, want)
        if inter is None:
            continue
        offsets, length = runs(stored.box, inter, size)
        if len(offsets) > MANY_RUNS:
            _strided_copy(files, stored, inter, want, out, size, stats, offsets, length)
            continue
        whole, direct = inter == stored.box, inter == want
        buf = out if direct else torch.empty(extents(inter), dtype=dtype)
        view = as_bytes(buf)
        for i, off in enumerate(offsets.tolist()):
            pread_into(files.fd(stored.file), view[i * length:(i + 1) * length], stored.offset + off,
                       files.path(stored.file), stats)
        if whole and verify:
            if hex_digest(view) != stored.checksum:
                raise ChecksumMismatchError(str(files.path(stored.file)),
                                            f"bytes of box {stored.box} of a tensor do not match their checksum")
            stats.boxes_verified += 1
        if not direct:
            region = out
            for d, ((s, e), (w0, _)) in enumerate(zip(inter, want)):
                region = region.narrow(d, s - w0, e - s)
            region.copy_(buf)
    return out
