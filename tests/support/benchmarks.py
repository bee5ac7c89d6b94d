"""The benchmark scripts of ``benchmarks/`` as modules, for the tests of what they compute.

``benchmarks/`` is not a package (and opacus installs a top-level ``benchmarks`` package of its
own), so a benchmark is loaded from its file rather than imported by name.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from support.processes import ROOT

BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """The module of ``benchmarks/<name>.py``, executed once per process and registered in
    ``sys.modules`` under ``name`` (as ``import name`` would, with ``benchmarks/`` on
    ``sys.path``); a later call returns the same module."""
    path = BENCHMARKS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
