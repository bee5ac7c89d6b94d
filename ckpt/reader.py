"""Read one target box of a tensor from the stored boxes that overlap it, byte range by byte
range (``os.preadv`` straight into the destination's memory where the layout allows).

Guarantees (``tests/test_ckpt_boxes.py``, ``property_tests/test_ckpt_properties.py``):
  * The result equals the global tensor's ``box`` bit for bit.
  * Only the bytes of the intersections are read: ``stats.bytes_read == stats.bytes_needed``
    for data (the manifest is counted apart, in ``metadata_bytes``).
  * A stored box read whole is checked against its xxh3 (``ChecksumMismatchError`` naming the
    file); a box read in part is not (its checksum covers bytes not read): ``ckpt.verify``
    checks whole files. A short read raises ``TruncatedShardError`` naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .boxes import Box, extents, intersect, runs
from .checksum import hex_digest
from .errors import ChecksumMismatchError, TruncatedShardError
from .format import TensorRecord, box_numel, dtype_of, itemsize
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


def read_box(record: TensorRecord, want: Box, open_file: Callable[[str], tuple[int, Path]], stats: ReadStats,
             *, verify: bool = True) -> Tensor:
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
        fd, path = open_file(stored.file)
        whole, direct = inter == stored.box, inter == want
        buf = out if direct else torch.empty(extents(inter), dtype=dtype)
        view = as_bytes(buf)
        offsets, length = runs(stored.box, inter, size)
        for i, off in enumerate(offsets.tolist()):
            pread_into(fd, view[i * length:(i + 1) * length], stored.offset + off, path, stats)
        if whole and verify:
            if hex_digest(view) != stored.checksum:
                raise ChecksumMismatchError(str(path), f"bytes of box {stored.box} of a tensor do not match their checksum")
            stats.boxes_verified += 1
        if not direct:
            region = out
            for d, ((s, e), (w0, _)) in enumerate(zip(inter, want)):
                region = region.narrow(d, s - w0, e - s)
            region.copy_(buf)
    return out


