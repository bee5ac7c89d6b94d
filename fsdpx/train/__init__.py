"""The top layer: the training job. Its configuration (``config.py``: the run as a tree of
sections; ``layout.py``: the parallel layout), what it trains (``sources.py``), the step built
(``build.py``) on the layout resolved once (``parallel.py``), the loop (``loop.py``), its segments
and checkpoints (``resume.py``, ``segments.py``, ``checkpoints.py``), the checks made before
anything is written (``preflight.py``), what it reports (``report.py``), the trained model for
transformers (``export.py``; ``fsdpx export``: ``export_cli.py``), the ``fsdpx train`` command
line (``cli.py``) and the torchrun launcher (``launch.py``).

The names below load on first use, as the ``fsdpx`` facade's do: ``fsdpx train --help`` imports
the command line, its configuration and nothing that loads torch (``tests/test_fast_feedback.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"ConfigError": "errors", "Layout": "layout", "RunConfig": "config", "build_step": "build",
           "export_checkpoint": "export_cli", "format_summary": "report", "load_gpt": "export", "run": "loop"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
