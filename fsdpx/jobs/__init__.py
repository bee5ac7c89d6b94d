"""Many jobs at once (issue 13): a Saturn-style planner over this library's parallelisms.

The pure core: a job is a :class:`Task`; a technique (``techniques.py``, built-ins in
``builtin.py``) says whether a job fits on some devices and how it runs there; a
:class:`~fsdpx.jobs.profile.ProfileTable` holds (step time, peak memory) per (job, technique,
device count); ``solve`` (``solver.py``) turns profiles into a :class:`~fsdpx.jobs.plan.Plan`
with one MILP on HiGHS, never worse than the greedy list schedule (``greedy.py``);
``simulate`` (``simulate.py``) replays a plan with events and re-plans. The impure edges:
``execute.py`` (torchrun processes), ``profile_store.py`` (the on-disk cache) and ``cli.py``.

Layer 3, beside ``fsdpx.train``; nothing imports it.

The built-in techniques (``builtin.py``, which loads torch) register themselves when the
registry is first used (``techniques.register_later``), so importing the package, and ``fsdpx
jobs --help``, stays light (``tests/test_fast_feedback.py``).
"""

import importlib
from typing import Any

from . import techniques
from .devices import Devices
from .task import DuplicateJobError, Privacy, Task, UnimportableTaskError
from .techniques import InfeasibleJobError, register

techniques.register_later(lambda: importlib.import_module(f"{__name__}.builtin"))

__all__ = ["Devices", "DuplicateJobError", "InfeasibleJobError", "Privacy", "Task", "UnimportableTaskError", "builtin",
           "register"]


def __getattr__(name: str) -> Any:
    if name == "builtin":  # the built-ins' module, imported on first use
        return importlib.import_module(f"{__name__}.builtin")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
