"""``verify``: is a directory a complete, intact checkpoint? Reads every byte once.

Checks, in order, raising the first failure (each names the file):
manifest present, parsable, self-checksum and schema (``ManifestError``); every shard file
present (``MissingShardError``) with its recorded size (``TruncatedShardError``) and whole-file
xxh3 (``ChecksumMismatchError``); no file in the directory that the manifest does not list
(``ManifestError``: a manifest that does not match its directory).

Guarantees: ``tests/test_ckpt_corruption.py`` flips a byte, truncates, deletes and adds files
and edits the manifest, and checks each gives its named error naming the file.
"""

from __future__ import annotations

from pathlib import Path

from .checksum import file_digest
from .errors import ChecksumMismatchError, ManifestError
from .format import MANIFEST, Manifest
from .loading import check_files_present, read_manifest


def verify(directory: str | Path) -> Manifest:
    """Check ``directory`` completely; return its manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files_present(directory, manifest)
    for name, rec in manifest.files.items():
        digest, _ = file_digest(directory / name)
        if digest != rec.checksum:
            raise ChecksumMismatchError(str(directory / name), "file content does not match its checksum in the manifest")
    extra = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST and p.name not in manifest.files)
    if extra:
        raise ManifestError(str(directory / MANIFEST), f"does not list files present in the checkpoint: {extra}")
    return manifest
