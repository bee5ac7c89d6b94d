"""The top layer: the training job. Its configuration (``config.py``: the run as a tree of
sections; ``layout.py``: the parallel layout), what it trains (``sources.py``), the step built
(``build.py``) on the layout resolved once (``parallel.py``), the loop (``loop.py``), its segments
and checkpoints (``resume.py``, ``segments.py``, ``checkpoints.py``), the checks made before
anything is written (``preflight.py``), what it reports (``report.py``), the ``fsdpx train`` command line (``cli.py``) and the torchrun launcher
(``launch.py``)."""

from .build import build_step
from .config import RunConfig
from .errors import ConfigError
from .layout import Layout
from .loop import run
from .report import format_summary

__all__ = ["ConfigError", "Layout", "RunConfig", "build_step", "format_summary", "run"]
