"""Local search over list schedules (pure, deterministic): the post-pass that improves a plan in
continuous time, with every job's exact seconds.

A plan here is an *order*: every job once, with one of its options, decoded by the list
schedule of ``greedy.in_order`` (each job in turn at its earliest start next to the ones before
it, backfilling). A left-justified schedule is the decoding of its own start order, so some
order decodes to an optimal plan; the search looks for one by moving a job at a time:

* *reinsert* a job: take it out and put it back at the position and with the option that decode
  best -- every position x every useful option, so option changes and moves are one
  neighbourhood --, trying the jobs that end last first and taking the first that improves;
* when no job's reinsertion improves, *perturb* the best order found: move ``RUIN`` jobs to
  random positions (a ``random.Random`` with a fixed seed) -- one of the jobs that end last on
  its next wider option, the others drawn at random, each on its option or the next narrower
  or wider one -- and search on from there (iterated local search).

Orders compare by ``(makespan, moment)`` or by the weighted completion time. The moment,
``sum_j g_j p_j (start_j + end_j)``, is the device-seconds weighted by when they are used: it
guides the search across the many orders of equal makespan towards ones that leave the end of
the plan free (on synthetic instances other than the benchmark's it found better makespans than
the sum of ends, which rewards a wide, short and costly option). Work is counted in job
placements, not seconds, so the same input gives the same order on any machine under any load;
a ``deadline`` (``solve``'s time limit) can only end it sooner, and only then does the order
depend on the machine.
"""

from __future__ import annotations

import bisect
import random
import time
from typing import Mapping, Sequence

from .plan import Option, Options, useful_options

RUIN = 2
"""Jobs moved by one perturbation."""

STEPS = (-1, 0, 1)
"""A randomly perturbed job's option moves by one of these steps in its list (by device count)."""

BUDGET = 1_000_000
"""Default job placements a search may make: about 1.1 s of one core (a placement costs about
1 us of Python); a search of 16 or more jobs uses all of it."""

PATIENCE = 40
"""Perturbations in a row that did not improve the best order, after which the search stops."""

Order = list[tuple[str, Option]]


class _Profile:
    """Devices in use over time: ``used[i]`` on ``[times[i], times[i+1])``, the last to infinity."""

    __slots__ = ("times", "used")

    def __init__(self, times: list[float] | None = None, used: list[int] | None = None) -> None:
        self.times = [0.0] if times is None else times
        self.used = [0] if used is None else used

    def copy(self) -> "_Profile":
        return _Profile(self.times[:], self.used[:])

    def place(self, option: Option, cluster_size: int) -> float:
        """Hold ``option.devices`` from the earliest time they stay free for ``option.seconds``
        (``greedy.earliest_start``'s rule: a start at 0 or where a job ends) and return it."""
        times, used, cap = self.times, self.used, cluster_size - option.devices
        n, i = len(times), 0
        while True:
            while used[i] > cap:
                i += 1
            start = times[i]
            end, k = start + option.seconds, i + 1
            while k < n and times[k] < end and used[k] <= cap:
                k += 1
            if k == n or times[k] >= end:
                break
            i = k + 1  # any start up to times[k] overlaps segment k, which is too full
        k = bisect.bisect_left(times, end, i)
        if k == n or times[k] != end:
            times.insert(k, end)
            used.insert(k, used[k - 1])
        for q in range(i, k):
            used[q] += option.devices
        return start


_NO_LIMIT = (float("inf"), float("inf"))


class _Search:
    """Decodes orders and counts the placements made."""

    def __init__(self, cluster_size: int, weights: Mapping[str, float] | None) -> None:
        self.G, self.weights, self.placements = cluster_size, weights, 0

    def _weight(self, job: str) -> float:
        return 1.0 if self.weights is None else self.weights.get(job, 1.0)

    def decode(self, order: Order, profile: _Profile, key: tuple[float, float], limit=_NO_LIMIT):
        """``key`` (``(makespan, moment)`` or ``(weighted completion, 0)``) of the jobs placed
        on ``profile`` so far, extended by ``order``'s jobs placed on it; ``None`` as soon as it
        cannot end below ``limit`` (both components only grow as jobs are added)."""
        top, total = key
        for job, o in order:
            end = profile.place(o, self.G) + o.seconds
            self.placements += 1
            if self.weights is None:
                top, total = max(top, end), total + o.devices * o.seconds * (2 * end - o.seconds)
            else:
                top += self._weight(job) * end
            if _beyond((top, total), limit):
                return None
        return top, total

    def key(self, order: Order) -> tuple[float, float]:
        return self.decode(order, _Profile(), (0.0, 0.0))

    def ends(self, order: Order) -> list[float]:
        profile = _Profile()
        return [profile.place(o, self.G) + o.seconds for _, o in order]

    def reinsert(self, rest: Order, job: str, options: Sequence[Option], limit=_NO_LIMIT):
        """The least ``(key, order)`` below ``limit`` of ``rest`` with ``job`` put back at some
        position with one of ``options`` (ties: the earlier position, then the earlier option);
        ``(None, None)`` if none is below ``limit``."""
        best_key, best = None, None
        prefix, prefix_key = _Profile(), (0.0, 0.0)
        for pos in range(len(rest) + 1):
            for o in options:
                key = self.decode([(job, o)] + rest[pos:], prefix.copy(), prefix_key, best_key or limit)
                if key is not None:
                    best_key, best = key, rest[:pos] + [(job, o)] + rest[pos:]
            if pos < len(rest):
                prefix_key = self.decode(rest[pos:pos + 1], prefix, prefix_key)
                if _beyond(prefix_key, best_key or limit):
                    break  # every later position keeps this prefix
        return best_key, best


def _beyond(partial: tuple[float, float], limit: tuple[float, float]) -> bool:
    """Whether a partial key, which adding jobs can only raise (component-wise), can no longer end
    lexicographically below ``limit``: its makespan already exceeds the limit's, or reached it
    with a moment at or above the limit's."""
    return partial[0] > limit[0] or (partial[0] >= limit[0] and partial[1] >= limit[1])


def _perturbed(order: Order, key: tuple[float, float], search: _Search, choices: Mapping[str, list[Option]],
               rng: random.Random) -> Order:
    """``order`` with ``RUIN`` jobs moved to random positions: for the makespan, one of the jobs
    that end last, on its next wider option (it can only end earlier by starting earlier or
    running faster); the others drawn at random, each on its option or the next narrower or
    wider one (``STEPS``)."""
    moved = rng.sample(sorted(choices), min(RUIN, len(choices)))
    if search.weights is None:
        ends = dict(zip((j for j, _ in order), search.ends(order)))
        last = rng.choice(sorted(j for j, e in ends.items() if e >= key[0] * (1 - 1e-9)))
        moved = [last] + [j for j in moved if j != last][: RUIN - 1]
    out = list(order)
    for n, job in enumerate(moved):
        now = next(o for j, o in out if j == job)
        step = 1 if n == 0 and search.weights is None else rng.choice(STEPS)
        k = min(max(choices[job].index(now) + step, 0), len(choices[job]) - 1)
        out = [(j, o) for j, o in out if j != job]
        out.insert(rng.randrange(len(out) + 1), (job, choices[job][k]))
    return out


def _better(a: tuple[float, float], b: tuple[float, float], tol: float = 1e-9) -> bool:
    """``a < b`` lexicographically by more than float noise (sums in another order differ in
    their last bits; taking that for progress would loop)."""
    if a[0] < b[0] - tol * abs(b[0]):
        return True
    return a[0] <= b[0] + tol * abs(b[0]) and a[1] < b[1] - tol * abs(b[1])


def improve(options: Options, order: Sequence[tuple[str, Option]], cluster_size: int, *,
            weights: Mapping[str, float] | None = None, budget: int = BUDGET, seed: int = 0,
            deadline: float | None = None) -> Order:
    """An order at least as good as ``order`` (every job of ``options`` once, with one of its
    options), found by the search above within ``budget`` job placements, or once ``PATIENCE``
    perturbations in a row found nothing better, or at ``deadline`` (a ``time.perf_counter()``
    value; checked after every reinsertion, the search's unit of work: about 0.1 s of one core
    for 64 jobs of 16 options).

    Objective: makespan (ties: the moment) when ``weights`` is None, else the weighted
    completion time. Deterministic: a function of the arguments only, unless the deadline ends
    it (``solve`` gives the search a share of its time limit).

    Guarantee: decoding the returned order (``greedy.in_order``) gives a schedule whose key is
    at most that of decoding ``order`` (``property_tests/test_jobs_properties.py::
    test_local_search_never_worsens_its_start``); every job keeps one of its own options.
    """
    search = _Search(cluster_size, weights)
    order = list(order)
    choices = {j: useful_options(options[j]) for j in options}
    for j, o in order:  # the start's options stay available even if dominated
        if o not in choices[j]:
            choices[j] = [*choices[j], o]
    best, best_key = order, search.key(order)
    current, current_key = best, best_key
    rng = random.Random(seed)
    stale = 0
    late = (lambda: time.perf_counter() >= deadline) if deadline is not None else (lambda: False)
    while search.placements < budget and len(order) > 1 and stale < PATIENCE and not late():
        ends = search.ends(current)
        improved = False
        for i in sorted(range(len(current)), key=lambda i: (-ends[i], current[i][0])):
            job = current[i][0]
            key, candidate = search.reinsert(current[:i] + current[i + 1:], job, choices[job], current_key)
            if key is not None and _better(key, current_key):
                current, current_key, improved = candidate, key, True
                break
            if search.placements >= budget or late():
                break
        if _better(current_key, best_key):
            best, best_key, stale = current, current_key, 0
        if not improved:
            stale += 1
            current = _perturbed(best, best_key, search, choices, rng)
            current_key = search.key(current)
    return best
