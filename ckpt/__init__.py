"""Sharded, atomic, resharding checkpoints of a train state (``docs/checkpoint-format.md``).

- ``save(directory, state, *, mesh, strategy, coordinator, blocking)`` -> ``SaveHandle``: every
  rank writes its own blocks; rank 0 commits atomically once all are durable.
- ``load(directory, *, mesh, strategy, rank)`` -> that rank's local state, in any mesh and
  strategy, reading only the byte ranges it needs;
  ``read_whole(directory, "params")``: each parameter whole, one at a time (an export).
- ``save_ranks`` / ``load_ranks``: the same on a simulated mesh (lists of per-rank states).
- ``CheckpointManager``: periodic saves, retention, ``latest()`` / ``restore()``.
- ``verify(directory)``: full integrity check. Coordinators: ``SingleProcess``, ``ThreadGroup``,
  ``TorchDistCoordinator``. Errors: ``ckpt.errors``.
"""

from . import errors
from .async_save import SaveHandle
from .coordinator import Coordinator, SingleProcess, ThreadGroup, TorchDistCoordinator
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    LayoutError,
    ManifestError,
    MissingAccountantError,
    MissingShardError,
    SaveError,
    ShapeMismatchError,
    TruncatedShardError,
    UnsupportedStateError,
    UnsupportedVersionError,
)
from .flatten import flatten, register_type, unflatten
from .format import FORMAT_VERSION, Manifest
from .loading import load, load_ranks, read_manifest, read_whole
from .manager import CheckpointManager, CorruptCheckpointWarning
from .reader import ReadStats
from .rules import make_rule, strategy_rule
from .saving import save, save_ranks
from .verify import verify

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "ChecksumMismatchError",
    "Coordinator",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "LayoutError",
    "Manifest",
    "ManifestError",
    "MissingAccountantError",
    "MissingShardError",
    "ReadStats",
    "SaveError",
    "SaveHandle",
    "ShapeMismatchError",
    "SingleProcess",
    "ThreadGroup",
    "TorchDistCoordinator",
    "TruncatedShardError",
    "UnsupportedStateError",
    "UnsupportedVersionError",
    "errors",
    "flatten",
    "load",
    "load_ranks",
    "make_rule",
    "read_manifest",
    "read_whole",
    "register_type",
    "save",
    "save_ranks",
    "strategy_rule",
    "unflatten",
    "verify",
]
