"""How a test starts another Python process that imports what the tests import."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""``tests/``: the folder holding the ``support`` package."""

ROOT = TESTS.parent
"""The repository root: the folder holding ``fsdpx``, ``privacy``, ``offload`` and ``ckpt``."""


def python_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with ``extra`` set and ``PYTHONPATH`` led by ``tests/`` and the repository
    root: a child Python started with it imports ``support`` (``python -m support.<module>``
    included) and this checkout's packages, whatever its working directory or script."""
    path = [str(TESTS), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(path)}
