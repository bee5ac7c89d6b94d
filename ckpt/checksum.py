"""Checksums of shard files and of the boxes inside them: xxh3-64, as 16 hex digits.

xxh3 is not cryptographic: it detects accidents (a flipped bit, a torn or truncated write, a
file from another checkpoint), not tampering. It runs at memory speed, so hashing while writing
costs little next to the write itself.

A shard file's checksum is ``shard_checksum(header, block digests)``: the xxh3 of its header
bytes followed by the 8-byte digests of its blocks in file order. Every data byte is thus
hashed once (for its block's own checksum), yet the file checksum covers every byte.

Guarantees: ``hex_digest(b)`` equals the digest of a hasher fed ``b`` in any split
(``tests/test_ckpt_format.py::test_streamed_checksum_equals_one_shot``); ``range_digest`` reads
its range once, in ``CHUNK`` pieces, never more than ``CHUNK`` bytes in memory.
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


def shard_checksum(header: bytes, block_digests: list[str]) -> str:
    """The checksum of a shard file made of ``header`` then blocks with these digests."""
    h = new_hasher()
    h.update(header)
    for d in block_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def range_digest(fd: int, offset: int, nbytes: int) -> str:
    """xxh3-64 of ``nbytes`` bytes of ``fd`` from ``offset`` (``EOFError`` if it ends first)."""
    h, buf = new_hasher(), bytearray(min(CHUNK, max(nbytes, 1)))
    view = memoryview(buf)
    while nbytes:
        n = os.preadv(fd, [view[:min(nbytes, len(view))]], offset)
        if n == 0:
            raise EOFError(offset)
        h.update(view[:n])
        offset, nbytes = offset + n, nbytes - n
    return h.hexdigest()
