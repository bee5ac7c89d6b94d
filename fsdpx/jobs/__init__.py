"""Many jobs at once (issue 13): a Saturn-style planner over this library's parallelisms.

The pure core: a job is a :class:`Task`; a technique (``techniques.py``, built-ins in
``builtin.py``) says whether a job fits on some devices and how it runs there; a
:class:`~fsdpx.jobs.profile.ProfileTable` holds (step time, peak memory) per (job, technique,
device count); ``solve`` (``solver.py``) turns profiles into a :class:`~fsdpx.jobs.plan.Plan`
with one MILP on HiGHS, never worse than the greedy list schedule (``greedy.py``);
``simulate`` (``simulate.py``) replays a plan with events and re-plans. The impure edges:
``execute.py`` (torchrun processes), ``profile_store.py`` (the on-disk cache) and ``cli.py``.

Layer 3, beside ``fsdpx.train``; nothing imports it.
"""

from . import builtin  # registers the built-in techniques
from .devices import Devices
from .task import DuplicateJobError, Privacy, Task, UnimportableTaskError
from .techniques import InfeasibleJobError, register

__all__ = ["Devices", "DuplicateJobError", "InfeasibleJobError", "Privacy", "Task", "UnimportableTaskError", "builtin",
           "register"]
