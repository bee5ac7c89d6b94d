"""The planning MILP on HiGHS (``scipy.optimize.milp``), time-indexed on a coarse slot grid.

Slots of ``delta`` seconds; job ``j``'s option ``o`` lasts ``d[j,o] = ceil(seconds / delta)``
slots on ``g[o]`` devices. Variables: ``x[j,o,t]`` binary (job ``j`` runs option ``o``
starting at slot ``t``, ``0 <= t <= T - d[j,o]``) and ``C`` continuous (the makespan, in slots).

    minimise   C + eps * sum_j end_j                   (makespan; eps breaks ties towards early ends)
           or  sum_j w_j end_j                         (weighted completion time)
    s.t.       sum_{o,t} x[j,o,t] = 1                  for every job j        (runs exactly once)
               sum_{j,o,t: t <= tau < t+d[j,o]} g[o] x[j,o,t] <= G
                                                       for every slot tau     (device capacity)
               end_j = sum_{o,t} (t + d[j,o]) x[j,o,t] <= C   for every job j
    where      eps = 1 / (2 (J T + 1)), so the tie-break never outweighs one slot of C.

``T`` (the horizon) is the makespan, in slots, of an incumbent schedule (``solve``'s best so far)
replayed with rounded durations, so that schedule is a feasible point and the MILP's slot
makespan is at most the incumbent's. Options that cannot fit the horizon are dropped: one
longer than ``T`` slots, or one whose device-slots plus every other job's least device-slots
exceed ``G T``. Real durations are at most the rounded ones, so the slot schedule stays feasible
in seconds; ``greedy.in_order`` then left-shifts it, never delaying a job.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from .greedy import in_order, makespan
from .plan import Option, Options, useful_options


@contextlib.contextmanager
def _stdout_silenced():
    """File descriptor 1 to /dev/null: some HiGHS builds print debug lines from C++ even with
    ``disp=False``."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@dataclass(frozen=True)
class MilpResult:
    """The slot schedule's choices ordered by slot start (``order``), HiGHS' status message,
    whether it proved optimality (in slots), and the grid used."""

    order: tuple[tuple[str, Option], ...]
    optimal: bool
    message: str
    delta: float
    slots: int
    variables: int


def solve_milp(options: Options, cluster_size: int, incumbent: Sequence[tuple[str, Option]], *, slots: int = 48,
               time_limit: float = 5.0, objective: str = "makespan", weights: Mapping[str, float] | None = None,
               mip_rel_gap: float = 0.02) -> MilpResult | None:
    """Solve the time-indexed MILP above on a grid of about ``slots`` slots spanning the
    makespan of ``incumbent`` (every job's ``(job, option)`` in start order, each option one of
    ``options``); returns the chosen option per job ordered by start slot, or ``None`` when
    HiGHS found no feasible point within ``time_limit`` seconds. The seconds spent building the
    model count toward ``time_limit``: HiGHS gets what is left (none left: ``None``).

    Determinism: fixed HiGHS options (presolve on, ``mip_rel_gap``, single-threaded
    branch-and-bound); the same input gives the same plan whenever the solve ends by
    optimality rather than by the time limit.
    """
    if objective not in ("makespan", "completion"):
        raise ValueError(f"objective must be 'makespan' or 'completion', got {objective!r}")
    began = time.perf_counter()
    delta = makespan(in_order(incumbent, cluster_size)) / slots
    slots_of = lambda o: max(1, math.ceil(o.seconds / delta - 1e-9))  # noqa: E731
    rounded = [(j, Option(o.technique, o.devices, float(slots_of(o)), o.params)) for j, o in incumbent]
    horizon = int(round(makespan(in_order(rounded, cluster_size))))
    opts = {j: [o for o in useful_options(options[j]) if slots_of(o) <= horizon] for j in sorted(options)}
    least = {j: min(o.devices * slots_of(o) for o in os_) for j, os_ in opts.items()}
    spare = cluster_size * horizon - sum(least.values())
    opts = {j: [o for o in os_ if o.devices * slots_of(o) - least[j] <= spare] for j, os_ in opts.items()}
    dur = {j: [slots_of(o) for o in os_] for j, os_ in opts.items()}

    cols: list[tuple[str, int, int]] = [(j, k, t) for j in opts for k, d in enumerate(dur[j])
                                        for t in range(horizon - d + 1)]
    n, jobs = len(cols), list(opts)
    row_of_job = {j: i for i, j in enumerate(jobs)}
    C = n  # index of the makespan variable
    eps = 1.0 / (2 * (len(jobs) * horizon + 1))
    w = weights or {}
    c = np.zeros(n + 1)
    rows, cidx, vals = [], [], []  # assignment rows, then capacity rows, then end rows
    for i, (j, k, t) in enumerate(cols):
        end = t + dur[j][k]
        c[i] = eps * end if objective == "makespan" else w.get(j, 1.0) * end
        rows.append(row_of_job[j]); cidx.append(i); vals.append(1.0)
        for tau in range(t, end):
            rows.append(len(jobs) + tau); cidx.append(i); vals.append(float(opts[j][k].devices))
        rows.append(len(jobs) + horizon + row_of_job[j]); cidx.append(i); vals.append(float(end))
    c[C] = 1.0 if objective == "makespan" else 0.0
    for r in range(len(jobs)):
        rows.append(len(jobs) + horizon + r); cidx.append(C); vals.append(-1.0)
    m = 2 * len(jobs) + horizon
    A = csr_array((vals, (rows, cidx)), shape=(m, n + 1))
    lo = np.concatenate([np.ones(len(jobs)), np.full(horizon, -np.inf), np.full(len(jobs), -np.inf)])
    hi = np.concatenate([np.ones(len(jobs)), np.full(horizon, float(cluster_size)), np.zeros(len(jobs))])
    integrality = np.concatenate([np.ones(n), [0]])
    bounds = Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [float(horizon)]]))
    left = time_limit - (time.perf_counter() - began)
    if left <= 0:
        return None
    with _stdout_silenced():
        res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=bounds,
                   options={"time_limit": float(left), "presolve": True, "mip_rel_gap": mip_rel_gap,
                            "disp": False})
    if res.x is None:
        return None
    chosen = sorted(((cols[i][2], cols[i][0], cols[i][1]) for i in range(n) if res.x[i] > 0.5))
    order = tuple((j, opts[j][k]) for _, j, k in chosen)
    return MilpResult(order, res.status == 0, res.message, delta, horizon, n + 1)
