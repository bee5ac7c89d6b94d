"""The clock both pipeline simulators run on: what an action waits for and costs, how ranks
sharing cores advance, and the ``Timeline`` a run gives.

``fsdpx.sharding.schedule_sim.simulate`` runs every rank's list in order and
``fsdpx.sharding.private_sim.simulate_private`` forms a private pipeline's ``W``s by the
executor's policy; both take their rules from here, so the two agree wherever their policies do
(``property_tests/test_private_sim_properties.py::test_free_w_leaves_the_schedule_as_simulated``):

* ``waits_for``: an action's inputs (the table of ``fsdpx.sharding.schedule_sim``'s docstring);
  ``ready_at``: when it may start, a receive no earlier than its send's end plus the message's
  transit (``Transfer``, ``transit_delay``);
* ``action_work``: each action's duration, or CPU work on shared cores (``DEFAULT_COSTS``
  merged with the caller's costs by kind, rank, stage and action); ``check_cores``;
* ``advance``: processor sharing between events, ``n`` running ranks each doing
  ``min(1, cores / n)`` work per unit of time;
* ``timeline_of``: the ``Timeline`` of the entries each rank ran, its peaks counted by
  ``peak_held``.

Definitions (``Timeline``):
  * ``makespan``: the last action's end (all ranks start at 0).
  * ``idle_time``: rank-time not spent in ``F``/``B``/``W``, ``p * makespan - compute``; time
    in transfers counts as idle. ``bubble = idle_time / (p * makespan)``, ``0`` when the
    makespan is ``0``.
  * ``peak_in_flight[s]``: the most microbatches stage ``s`` holds at once, a microbatch being
    held from the start of its ``F`` to the end of its ``W`` (the activations a ``W`` still
    reads). One rank runs all of a stage's actions one after another, so this is counted in
    list order and does not depend on costs (a private timeline's, whose ``W``s move with the
    clock, in the order its ranks ran them: ``fsdpx.sharding.private_sim``).
    ``peak_in_flight_by_rank`` counts a rank's stages together.

Times are exact when the costs are ints (or ``Fraction``s).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Sequence

from .schedule import ACTION_KINDS, COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, Schedule, W, matching

DEFAULT_COSTS: Mapping[str, float] = MappingProxyType(
    {"F": 1, "B": 1, "W": 1, "SEND_F": 0, "RECV_F": 0, "SEND_B": 0, "RECV_B": 0}
)


class Transfer(NamedTuple):
    """The time a message spends between two ranks: ``latency + message_bytes *
    seconds_per_byte`` (``delay``), from the end of its send to the earliest end of its
    receive. One activation and its gradient have the same shape, so one ``message_bytes``
    prices both directions. Every field ``0`` (the default) is free transit: ``simulate`` then
    returns exactly the timeline it returns without a ``Transfer``.

    Measured, not fitted: ``benchmarks/pipeline.py`` times a send/receive of a small message
    (``latency``) and of one activation on the same gloo group."""

    latency: Real = 0
    seconds_per_byte: Real = 0
    message_bytes: Real = 0

    @property
    def delay(self) -> Real:
        return self.latency + self.message_bytes * self.seconds_per_byte


class Deadlock(RuntimeError):
    """No rank can run its next action; the message names each blocked rank and its wait."""


class Entry(NamedTuple):
    """One action as run: ``(start, end, action)``."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Timeline:
    """A schedule as run on the clock (definitions in the module docstring).

    * ``ranks[r]``: rank ``r``'s ``Entry``s in the order it ran them.
    * ``makespan``, ``compute_time`` (sum of ``F``/``B``/``W`` durations over ranks).
    * ``peak_in_flight``: per stage; ``peak_in_flight_by_rank``: per rank."""

    schedule: Schedule
    ranks: tuple[tuple[Entry, ...], ...]
    makespan: float
    compute_time: float
    peak_in_flight: tuple[int, ...]
    peak_in_flight_by_rank: tuple[int, ...]

    @property
    def idle_time(self) -> float:
        return self.schedule.num_ranks * self.makespan - self.compute_time

    @property
    def bubble(self) -> float:
        """Idle fraction of all rank-time, ``idle_time / (p * makespan)``; 0 for a zero makespan."""
        total = self.schedule.num_ranks * self.makespan
        return self.idle_time / total if total else 0.0

    def by_action(self) -> dict[Action, Entry]:
        """Every action's ``Entry``, keyed by the action."""
        return {e.action: e for entries in self.ranks for e in entries}


def transit_delay(transfer: Transfer | None) -> Real:
    """``transfer``'s delay (``0`` without one); ``ValueError`` when negative
    (``tests/test_schedule.py::test_one_microbatch_with_a_message_in_transit_by_hand``)."""
    delay = transfer.delay if transfer is not None else 0
    if delay < 0:
        raise ValueError(f"a transfer's delay must be >= 0, got {transfer}")
    return delay


def check_cores(cores: int | None) -> None:
    """``ValueError`` unless ``cores`` is ``None`` (a core per rank) or a positive int (not a
    bool) (``tests/test_schedule.py::test_two_ranks_on_one_core_share_it_while_both_compute``)."""
    if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
        raise ValueError(f"cores must be a positive int, got {cores!r}")


def action_work(schedule: Schedule, costs, rank_costs, stage_costs, action_costs) -> Callable[[Action], Real]:
    """Each action's duration (or CPU work on shared cores), as ``simulate`` documents it:
    ``action_costs`` over ``stage_costs`` over ``rank_costs`` over ``costs`` over
    ``DEFAULT_COSTS``; ``ValueError`` for a negative cost, an unknown kind or a wrong length
    (``property_tests/test_schedule_properties.py::test_each_action_costs_what_its_stage_is_given``,
    ``tests/test_schedule.py::test_bad_costs_are_refused``)."""
    p, num_stages = schedule.num_ranks, schedule.num_stages
    own = dict(action_costs or {})
    if any(c < 0 for c in own.values()):
        raise ValueError(f"action costs must be >= 0, got {min(own.values())}")
    if rank_costs is not None and len(rank_costs) != p:
        raise ValueError(f"rank_costs has {len(rank_costs)} entries for {p} ranks")
    if stage_costs is not None and len(stage_costs) != num_stages:
        raise ValueError(f"stage_costs has {len(stage_costs)} entries for {num_stages} stages")
    # per stage (each stage runs on one rank), the merged durations by action kind
    cost_of = [_costs({**(costs or {}), **(rank_costs[schedule.rank_of(st)] if rank_costs is not None else {}),
                       **(stage_costs[st] if stage_costs is not None else {})}) for st in range(num_stages)]

    def work(a: Action) -> Real:
        return own[a] if a in own else cost_of[a.stage][a.kind]
    return work


def _costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    out = dict(DEFAULT_COSTS)
    for k, c in (costs or {}).items():
        if k not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {k!r} in costs; kinds are {ACTION_KINDS}")
        if c < 0:
            raise ValueError(f"cost of {k} must be >= 0, got {c}")
        out[k] = c
    return out


def timeline_of(schedule: Schedule, entries: list[list[Entry]]) -> Timeline:
    """The ``Timeline`` of ``entries`` (each rank's, in the order it ran them); in-flight
    peaks counted in that order, which is each rank's list order unless a policy moved its
    ``W``s (``fsdpx.sharding.private_sim``). Makespan 0 for no entries
    (``tests/test_schedule.py::test_zero_costs_give_an_empty_timeline_without_dividing_by_zero``)."""
    compute = sum(e.end - e.start for rank in entries for e in rank if isinstance(e.action, COMPUTE))
    ran = [tuple(e.action for e in rank) for rank in entries]
    return Timeline(
        schedule=schedule,
        ranks=tuple(tuple(e) for e in entries),
        makespan=max((rank[-1].end for rank in entries if rank), default=0),
        compute_time=compute,
        peak_in_flight=tuple(peak_held(ran[schedule.rank_of(s)], lambda a, s=s: a.stage == s)
                             for s in range(schedule.num_stages)),
        peak_in_flight_by_rank=tuple(peak_held(actions, lambda a: True) for actions in ran),
    )


def peak_held(actions: Sequence[Action], counted: Callable[[Action], bool],
              per_stage: Sequence[Real] | None = None) -> Real:
    """The most held at once along ``actions``: each ``counted`` microbatch from its ``F`` to its
    ``W``, weighing ``per_stage[s]`` at stage ``s`` (1 without ``per_stage``); 0 for none
    (``property_tests/test_schedule_properties.py::test_peak_held_weighs_in_flight_microbatches_by_stage``)."""
    held = peak = 0
    for a in actions:
        if counted(a) and isinstance(a, (F, W)):
            weight = 1 if per_stage is None else per_stage[a.stage]
            held += weight if isinstance(a, F) else -weight
            peak = max(peak, held)
    return peak


def ready_at(a: Action, deps: list[Action], ends: Mapping[Action, float], free: float, delay: float) -> float:
    """When ``a`` may start: its rank free, what it waits for ended (a receive's send plus the
    message's transit). Every ``deps`` must have ended (be in ``ends``)
    (``property_tests/test_schedule_properties.py::test_transit_time_delays_only_receivers``)."""
    if delay and isinstance(a, (RECV_F, RECV_B)):  # its only wait is the send, then transit
        return max(free, ends[deps[0]] + delay)
    return max([free, *(ends[d] for d in deps)])


def advance(running: dict[int, list], cores: int | None, t: Real,
            wake: Real | None) -> tuple[Real, list[tuple[int, Real, Action]]]:
    """Processor sharing from ``t`` to the earlier of ``wake`` and the first end of a running
    action (``running``: rank -> ``[start, work left, action, work]``; ``n`` running ranks each
    do ``min(1, cores / n)`` work per unit of time, all of it with ``cores`` None). Returns the
    new time and the ``(rank, start, action)`` that ended there, taken out of ``running``.
    Exact for exact costs (``Fraction`` shares)
    (``property_tests/test_schedule_properties.py::test_shared_cores_stretch_the_timeline_by_at_most_p_over_c``)."""
    share, step = Fraction(1), None
    if running:
        n = len(running)
        share = Fraction(min(cores, n) if cores is not None else n, n)
        step = min(left / share for _, left, _, _ in running.values())
    if step is None or (wake is not None and wake - t <= step):
        step, t = wake - t, wake  # land on the wake-up exactly, floats included
    else:
        t = t + step
    ended = []
    for r, job in list(running.items()):
        start, left, a, total = job
        job[1] = left - step * share
        if job[1] <= (0 if isinstance(job[1], (int, Fraction)) else 1e-12 * total):
            del running[r]
            ended.append((r, start, a))
    return t, ended


def waits_for(a: Action, schedule: Schedule) -> list[Action]:
    """What ``a`` waits for besides its rank (the table of ``fsdpx.sharding.schedule_sim``'s
    docstring): for a forward, the previous stage's forward and, across ranks, its receive;
    for a backward, its forward, the next stage's backward and, across ranks, its receive; a
    ``W`` its ``B``; a send the action whose data it sends; a receive its send
    (``property_tests/test_schedule_properties.py::
    test_simulation_never_deadlocks_and_orders_forward_backward_weight``)."""
    s, mb, p = a.stage, a.mb, schedule.num_ranks
    here = schedule.rank_of(s)
    if isinstance(a, F):
        if s == 0:
            return []
        prev = schedule.rank_of(s - 1)
        return [F(mb, s - 1)] + ([RECV_F(mb, s, prev)] if prev != here else [])
    if isinstance(a, B):
        if s == schedule.num_stages - 1:
            return [F(mb, s)]
        nxt = schedule.rank_of(s + 1)
        return [F(mb, s), B(mb, s + 1)] + ([RECV_B(mb, s, nxt)] if nxt != here else [])
    if isinstance(a, W):
        return [B(mb, s)]
    if isinstance(a, SEND_F):
        return [F(mb, s)]
    if isinstance(a, SEND_B):
        return [B(mb, s)]
    return [matching(a, p)]  # a receive
