"""The top layer: the training job (``loop.py``), its embedded corpus (``data.py``), the
``fsdpx`` command line (``cli.py``) and the torchrun launcher (``launch.py``)."""

from .loop import ConfigError, RunConfig, build_step, format_summary, run, run_mesh

__all__ = ["ConfigError", "RunConfig", "build_step", "format_summary", "run", "run_mesh"]
