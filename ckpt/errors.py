"""The named errors of ``ckpt``. Every error about a file on disk carries that file's path.

Hierarchy::

    CheckpointError
      CorruptCheckpointError (.path)     the bytes on disk are not what the manifest promised
        ManifestError                    missing, unparsable, self-checksum or schema mismatch
        MissingShardError                a shard file the manifest lists is absent
        TruncatedShardError              a shard file is shorter (or longer) than recorded
        ChecksumMismatchError            a file's or a box's xxh3 differs from the manifest's
      UnsupportedVersionError            written by a newer, unknown format version
      CheckpointExistsError (.path)      saving over an existing checkpoint (never done in place)
      SaveError                          a save failed; nothing was committed
      LayoutError                        ranks' local tensors do not fit one global layout
      UnsupportedStateError              a leaf that cannot be stored without pickling
      ShapeMismatchError                 loading into a model whose shapes differ (names the tensor)
      MissingAccountantError             a private run without its accountant ledger
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by ``ckpt``."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest. ``path`` is the offending file."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


class ManifestError(CorruptCheckpointError):
    """The manifest is missing, unparsable, fails its own checksum or breaks the schema."""


class MissingShardError(CorruptCheckpointError):
    """A shard file listed by the manifest does not exist."""


class TruncatedShardError(CorruptCheckpointError):
    """A shard file's size differs from the size recorded in the manifest."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A shard file's (or one box's) xxh3 checksum differs from the manifest's."""


class UnsupportedVersionError(CheckpointError):
    """The checkpoint was written with a format version this library cannot read."""


class CheckpointExistsError(CheckpointError):
    """The target checkpoint directory already exists; checkpoints are never rewritten in place."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: a checkpoint already exists here; checkpoints are never overwritten")
        self.path = str(path)


class SaveError(CheckpointError):
    """A save failed on some rank; no checkpoint was committed. ``__cause__`` is the original
    error on the rank where it happened."""


class LayoutError(CheckpointError):
    """Ranks' local tensors do not fit one global layout (the message names the tensor)."""


class UnsupportedStateError(CheckpointError):
    """A state leaf cannot be stored as tensors and JSON (the message names its path)."""


class ShapeMismatchError(CheckpointError):
    """The checkpoint's tensors do not have the shapes the caller expects (names the tensor)."""


class MissingAccountantError(CheckpointError):
    """A private run's state has no accountant ledger, so its privacy guarantee cannot be kept."""
