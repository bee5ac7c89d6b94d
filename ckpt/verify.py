"""``verify``: is a directory a complete, intact checkpoint? Reads every byte once.

Checks, in order, raising the first failure (each names the file):
manifest present, parsable, self-checksum and schema (``ManifestError``); every shard file
present (``MissingShardError``) with its recorded size (``TruncatedShardError``); its blocks
back to back from the header's end to the file's end (``ManifestError``); every block's xxh3 and
the file checksum over header and block digests (``ChecksumMismatchError``); no file in the
directory that the manifest does not list (``ManifestError``: a manifest that does not match
its directory).

Guarantees: ``tests/test_ckpt_corruption.py`` flips a byte, truncates, deletes and adds files
and edits the manifest, and checks each gives its named error naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checksum import range_digest, shard_checksum
from .errors import ChecksumMismatchError, ManifestError
from .format import MANIFEST, BoxRecord, Manifest
from .loading import check_files_present, read_manifest


def _blocks_by_file(manifest: Manifest) -> dict[str, list[BoxRecord]]:
    out: dict[str, list[BoxRecord]] = {name: [] for name in manifest.files}
    for rec in manifest.tensors.values():
        for b in rec.boxes:
            out[b.file].append(b)
    return {name: sorted(bs, key=lambda b: b.offset) for name, bs in out.items()}


def verify_shard(path: Path, size: int, checksum: str, blocks: list[BoxRecord]) -> None:
    """Every byte of one shard file against its block checksums and its file checksum."""
    ends = [blocks[0].offset if blocks else size] + [b.offset + b.nbytes for b in blocks]
    if any(b.offset != end for b, end in zip(blocks, ends)) or ends[-1] != size:
        raise ManifestError(str(path), "the manifest's blocks do not tile the file after its header")
    fd = os.open(path, os.O_RDONLY)
    try:
        header = os.pread(fd, ends[0], 0)
        for b in blocks:
            if range_digest(fd, b.offset, b.nbytes) != b.checksum:
                raise ChecksumMismatchError(str(path), f"bytes [{b.offset}, {b.offset + b.nbytes}) of box {b.box} "
                                                       "do not match their checksum")
    finally:
        os.close(fd)
    if shard_checksum(header, [b.checksum for b in blocks]) != checksum:
        raise ChecksumMismatchError(str(path), "file header does not match the file checksum in the manifest")


def verify(directory: str | Path) -> Manifest:
    """Check ``directory`` completely; return its manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files_present(directory, manifest)
    for name, blocks in _blocks_by_file(manifest).items():
        rec = manifest.files[name]
        verify_shard(directory / name, rec.size, rec.checksum, blocks)
    extra = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST and p.name not in manifest.files)
    if extra:
        raise ManifestError(str(directory / MANIFEST), f"does not list files present in the checkpoint: {extra}")
    return manifest
