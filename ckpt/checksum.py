"""Checksums of shard files and of the boxes inside them: xxh3-64, as 16 hex digits.

xxh3 is not cryptographic: it detects accidents (a flipped bit, a torn or truncated write, a
file from another checkpoint), not tampering. It runs at memory speed, so hashing while writing
costs little next to the write itself.

Guarantees: ``hex_digest(b)`` equals the digest of a ``Hasher`` fed ``b`` in any split
(``tests/test_ckpt_format.py::test_streamed_checksum_equals_one_shot``); ``file_digest`` reads
the whole file once, in ``CHUNK`` pieces, never more than ``CHUNK`` bytes in memory.
"""

from __future__ import annotations

import os

import xxhash

ALGORITHM = "xxh3_64"
CHUNK = 8 << 20


def new_hasher() -> "xxhash.xxh3_64":
    """A streaming hasher: ``h.update(buffer)`` then ``h.hexdigest()``."""
    return xxhash.xxh3_64()


def hex_digest(data: bytes | bytearray | memoryview) -> str:
    """xxh3-64 of ``data`` as 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    """``(xxh3-64 hex digest, size in bytes)`` of a whole file."""
    h, size = new_hasher(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size
