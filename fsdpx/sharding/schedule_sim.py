"""Run a pipeline ``Schedule`` on a clock: when each action starts and ends, the bubble, memory.

``simulate(schedule, costs)`` is pure: no process, thread or real clock. Each rank runs its list
in order, one action at a time; an action starts when its rank is free and its inputs exist:

=========================  =====================================================================
action                     waits for
=========================  =====================================================================
``F(mb, s)``               ``F(mb, s - 1)``, and ``RECV_F(mb, s, .)`` when stage ``s - 1`` is
                           remote
``B(mb, s)``               ``F(mb, s)``; ``B(mb, s + 1)``, and ``RECV_B(mb, s, .)`` when remote
``W(mb, s)``               ``B(mb, s)``
``SEND_F`` / ``SEND_B``    the ``F`` / ``B`` whose data it sends (buffered: it never waits for
                           the receiver)
``RECV_F`` / ``RECV_B``    the end of the matching send, plus the message's time in transit
                           (``Transfer``; ``0`` by default)
=========================  =====================================================================

A well-formed list already orders most of these (a receive sits before its consumer); the
explicit waits make a malformed one (a receive listed after its consumer) deadlock instead of
running on data that is not there yet.

Costs (``DEFAULT_COSTS``): ``F = B = W = 1``, every transfer ``0``. A transfer's cost is the
time it occupies its own rank (posting a send, waiting out a receive's bookkeeping); the time a
message spends between the ranks is the ``Transfer`` model's, paid by the receiver only: a
send never waits for it (buffered, as the executor's), a receive cannot end before its message
arrives. With gpipe's and 1f1b's
fused backward (``B, W`` then the send, see ``fsdpx.sharding.schedule``) the backward costs
``B + W = 2``, twice the forward, and the bubble is exactly ``(p - 1) / (m + p - 1)``.
Measured costs differ by rank (``rank_costs``) and, on an interleaved rank, by stage
(``stage_costs``: a rank's chunks need not cost the same).

Shared cores (``cores=c``): the ranks run on ``c`` cores of one host instead of one core each
(four gloo processes on a two-core machine). An action's cost is then the CPU work it needs,
and while ``n`` ranks are inside actions that need work each advances at ``min(1, c / n)`` per
unit of time (processor sharing, what the kernel's fair scheduler approximates over a time
slice); a rank waiting for its inputs, or a message in transit, uses no core. An action's
duration (``end - start``) is its wall time, so time a rank spends inside an ``F`` waiting for
a core counts as computing, as a timer around the real ``F`` counts it.

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

A schedule where no rank can move raises ``Deadlock`` naming each blocked rank, the action it
is stuck at and what that action waits for. ``plot(timeline, path)`` draws the Gantt chart.
"""

from __future__ import annotations

from collections import deque
from numbers import Real
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Sequence

from .schedule import ACTION_KINDS, COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, Schedule, W, check, matching

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


def simulate(schedule: Schedule, costs: Mapping[str, float] | None = None, *,
             rank_costs: Sequence[Mapping[str, float]] | None = None,
             stage_costs: Sequence[Mapping[str, float]] | None = None,
             transfer: Transfer | None = None, action_costs: Mapping[Action, float] | None = None,
             cores: int | None = None) -> Timeline:
    """Run ``schedule`` with durations ``costs`` (by action kind, merged over
    ``DEFAULT_COSTS``) and return its ``Timeline``. ``rank_costs[r]``, when given, overrides
    ``costs`` for rank ``r`` (unbalanced stages: the last also runs the LM head and the loss);
    ``stage_costs[s]`` overrides both for the actions of stage ``s`` (an action's stage: its
    own, for a transfer the stage that sends or receives it), which is what an interleaved
    rank needs, its chunks differing (the last holds the LM head). An action of stage ``s``
    on rank ``r`` costs ``{**DEFAULT_COSTS, **costs, **rank_costs[r], **stage_costs[s]}``.
    ``transfer`` adds each message's time in transit: a receive starts no earlier than its
    send's end plus ``transfer.delay``. ``action_costs[a]``, where given, is action ``a``'s own
    duration, over all of these: a replay of one measured step, action by action. ``cores``:
    the ranks share that many cores (module docstring; ``None``: a core each), costs being
    CPU work.

    Guarantees (``property_tests/test_schedule_properties.py``):
      * every action runs once; a rank's entries follow its list and never overlap; each
        action starts no earlier than what it waits for ends (module table), so each
        ``F`` ends before its ``B`` starts and each ``B`` before its ``W``
        (``test_simulation_never_deadlocks_and_orders_forward_backward_weight``);
      * with ``DEFAULT_COSTS`` gpipe and 1f1b have ``bubble == (p - 1) / (m + p - 1)``
        (``test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1``);
      * ``stage_costs`` repeating one mapping, or each stage its rank's ``rank_costs``, gives
        exactly the timeline of ``costs`` / ``rank_costs`` alone
        (``test_stage_costs_equal_to_rank_costs_give_the_same_timeline``);
      * ``action_costs`` giving each action the cost its kind and stage give it is the same
        timeline (``test_action_costs_equal_to_stage_costs_give_the_same_timeline``);
      * a zero ``Transfer`` gives exactly the timeline without one
        (``test_zero_transfer_gives_the_timeline_without_one``); a delay ``d`` makes no
        action earlier, leaves every rank's actions before its first receive where they were,
        lets every receive end no earlier than its send's end plus ``d``, and delays the
        makespan by at most ``d`` per receive (``test_transit_time_delays_only_receivers``);
        gpipe's makespan with unit costs is ``3 (m + p - 1) + 2 (p - 1) d``, one ``d`` per
        boundary each way (``test_gpipe_makespan_grows_by_one_delay_per_boundary_each_way``);
      * ``cores >= p`` gives the timeline of a core per rank (exactly for exact costs, within
        rounding for floats), with the ordering guarantees above for any ``cores``
        (``test_as_many_cores_as_ranks_changes_nothing``); one core and free transit run the
        step's total work back to back (``test_one_core_runs_the_total_work_back_to_back``);
        ``c`` cores make no action end earlier than with a core per rank, and none later than
        that timeline stretched by ``p / c``, so ``max(M, work / c) <= makespan <= M p / c``
        (``test_shared_cores_stretch_the_timeline_by_at_most_p_over_c``).

    Times are exact when the costs are ints (or ``Fraction``s).

    Raises ``ValueError`` for a cost key not in ``ACTION_KINDS``, a negative cost or delay,
    ``cores`` below 1, for
    ``rank_costs`` / ``stage_costs`` of the wrong length, and for a schedule ``check`` rejects;
    ``Deadlock`` when the ranks block each other."""
    check(schedule)
    delay = _delay(transfer)
    work = _work(schedule, costs, rank_costs, stage_costs, action_costs)
    _check_cores(cores)
    if cores is None:
        entries = _run_core_each(schedule, work, delay)
    else:
        entries = _run_shared(schedule, work, delay, cores)
    return _timeline(schedule, entries)


def _delay(transfer: Transfer | None) -> Real:
    """``transfer``'s delay (``0`` without one); ``ValueError`` when negative."""
    delay = transfer.delay if transfer is not None else 0
    if delay < 0:
        raise ValueError(f"a transfer's delay must be >= 0, got {transfer}")
    return delay


def _check_cores(cores: int | None) -> None:
    if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
        raise ValueError(f"cores must be a positive int, got {cores!r}")


def _work(schedule: Schedule, costs, rank_costs, stage_costs, action_costs) -> Callable[[Action], Real]:
    """Each action's duration (or CPU work on shared cores), as ``simulate`` documents it:
    ``action_costs`` over ``stage_costs`` over ``rank_costs`` over ``costs`` over
    ``DEFAULT_COSTS``; ``ValueError`` for a negative cost, an unknown kind or a wrong length."""
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


def _timeline(schedule: Schedule, entries: list[list[Entry]]) -> Timeline:
    """The ``Timeline`` of ``entries`` (each rank's, in the order it ran them); in-flight
    peaks counted in that order, which is each rank's list order unless a policy moved its
    ``W``s (``fsdpx.sharding.private_sim``)."""
    compute = sum(e.end - e.start for rank in entries for e in rank if isinstance(e.action, COMPUTE))
    ran = [tuple(e.action for e in rank) for rank in entries]
    return Timeline(
        schedule=schedule,
        ranks=tuple(tuple(e) for e in entries),
        makespan=max((rank[-1].end for rank in entries if rank), default=0),
        compute_time=compute,
        peak_in_flight=tuple(_peak(ran[schedule.rank_of(s)], lambda a, s=s: a.stage == s)
                             for s in range(schedule.num_stages)),
        peak_in_flight_by_rank=tuple(_peak(actions, lambda a: True) for actions in ran),
    )


def _ready(a: Action, deps: list[Action], ends: Mapping[Action, float], free: float, delay: float) -> float:
    """When ``a`` may start: its rank free, what it waits for ended (a receive's send plus the
    message's transit)."""
    if delay and isinstance(a, (RECV_F, RECV_B)):  # its only wait is the send, then transit
        return max(free, ends[deps[0]] + delay)
    return max([free, *(ends[d] for d in deps)])


def _run_core_each(schedule: Schedule, work, delay: float) -> list[list[Entry]]:
    """Every rank on its own core: each action ends its cost after it may start."""
    p = schedule.num_ranks
    ends: dict[Action, float] = {}
    entries: list[list[Entry]] = [[] for _ in range(p)]
    free = [0] * p
    runnable = deque(range(p))
    blocked_on: dict[Action, list[int]] = {}  # a missing input -> the ranks stuck waiting for it
    while runnable:
        r = runnable.popleft()
        actions = schedule.ranks[r]
        while len(entries[r]) < len(actions):
            a = actions[len(entries[r])]
            deps = _waits_for(a, schedule)
            missing = next((d for d in deps if d not in ends), None)
            if missing is not None:
                blocked_on.setdefault(missing, []).append(r)
                break
            start = _ready(a, deps, ends, free[r], delay)
            end = start + work(a)
            entries[r].append(Entry(start, end, a))
            ends[a] = free[r] = end
            runnable.extend(blocked_on.pop(a, ()))
    if any(len(e) < len(a) for e, a in zip(entries, schedule.ranks)):
        raise Deadlock(_deadlock_message(schedule, entries, ends))
    return entries


def _run_shared(schedule: Schedule, work, delay: float, cores: int) -> list[list[Entry]]:
    """The ranks on ``cores`` shared cores (processor sharing, module docstring): an event loop
    over the times an action ends or a message arrives. Between two events the ``n`` ranks
    inside an action with work left each do ``min(1, cores / n)`` work per unit of time; a
    zero-cost action ends as it starts. Exact for exact costs (``Fraction`` shares)."""
    p = schedule.num_ranks
    ends: dict[Action, float] = {}
    entries: list[list[Entry]] = [[] for _ in range(p)]
    free: list[float] = [0] * p
    running: dict[int, list] = {}  # rank -> [start, work left, action, work]
    t: float = 0
    while True:
        arrival = None  # the next time a waiting receive's message arrives
        started = True
        while started:  # start what may start now; zero-cost actions end at once, unblocking more
            started, arrival = False, None
            for r in range(p):
                if r in running or len(entries[r]) == len(schedule.ranks[r]):
                    continue
                a = schedule.ranks[r][len(entries[r])]
                deps = _waits_for(a, schedule)
                if any(d not in ends for d in deps):
                    continue
                ready, cost = _ready(a, deps, ends, free[r], delay), work(a)
                if ready > t:
                    arrival = ready if arrival is None else min(arrival, ready)
                elif cost == 0:
                    entries[r].append(Entry(ready, ready, a))
                    ends[a] = free[r] = ready
                    started = True
                else:
                    running[r] = [ready, cost, a, cost]
        if not running and arrival is None:
            break
        t, ended = _advance(running, cores, t, arrival)
        for r, start, a in ended:
            entries[r].append(Entry(start, t, a))
            ends[a] = free[r] = t
    if any(len(e) < len(a) for e, a in zip(entries, schedule.ranks)):
        raise Deadlock(_deadlock_message(schedule, entries, ends))
    return entries


def _advance(running: dict[int, list], cores: int | None, t: Real,
             wake: Real | None) -> tuple[Real, list[tuple[int, Real, Action]]]:
    """Processor sharing from ``t`` to the earlier of ``wake`` and the first end of a running
    action (``running``: rank -> ``[start, work left, action, work]``; ``n`` running ranks each
    do ``min(1, cores / n)`` work per unit of time, all of it with ``cores`` None). Returns the
    new time and the ``(rank, start, action)`` that ended there, taken out of ``running``.
    Exact for exact costs (``Fraction`` shares)."""
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


def _costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    out = dict(DEFAULT_COSTS)
    for k, c in (costs or {}).items():
        if k not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {k!r} in costs; kinds are {ACTION_KINDS}")
        if c < 0:
            raise ValueError(f"cost of {k} must be >= 0, got {c}")
        out[k] = c
    return out


def _waits_for(a: Action, schedule: Schedule) -> list[Action]:
    """What ``a`` waits for besides its rank (module table)."""
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


def _deadlock_message(schedule: Schedule, entries: list[list[Entry]], ends: Mapping[Action, float]) -> str:
    lines = []
    for r, actions in enumerate(schedule.ranks):
        if len(entries[r]) < len(actions):
            a = actions[len(entries[r])]
            missing = ", ".join(repr(d) for d in _waits_for(a, schedule) if d not in ends)
            lines.append(f"rank {r} is stuck at {a!r} (action {len(entries[r])} of {len(actions)}),"
                         f" waiting for {missing}")
    return "deadlock, no rank can move:\n  " + "\n  ".join(lines)


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches whose ``F`` has started and whose ``W`` has not ended
    (see the module docstring); a pure function of the schedule. 1f1b keeps at most
    ``p - s`` at stage ``s``, gpipe all ``m``, zero_bubble at most ``p``
    (``test_in_flight_microbatches``)."""
    return tuple(
        _peak(schedule.ranks[schedule.rank_of(s)], lambda a, s=s: a.stage == s) for s in range(schedule.num_stages)
    )


def peak_held_by_rank(schedule: Schedule, per_stage: Sequence[Real]) -> tuple[Real, ...]:
    """Per rank, the most it holds at once when a microbatch at stage ``s`` holds
    ``per_stage[s]`` (the bytes its activations keep, say) from the start of its ``F`` to the end
    of its ``W``. All ones give ``peak_in_flight_by_rank``; with one stage per rank, ``per_stage``
    times ``peak_in_flight`` (``test_peak_held_weighs_in_flight_microbatches_by_stage``)."""
    if len(per_stage) != schedule.num_stages:
        raise ValueError(f"per_stage has {len(per_stage)} entries for {schedule.num_stages} stages")
    return tuple(_peak(actions, lambda a: True, per_stage) for actions in schedule.ranks)


def _peak(actions: tuple[Action, ...], counted, per_stage: Sequence[Real] | None = None):
    held = peak = 0
    for a in actions:
        if counted(a) and isinstance(a, (F, W)):
            weight = 1 if per_stage is None else per_stage[a.stage]
            held += weight if isinstance(a, F) else -weight
            peak = max(peak, held)
    return peak


# ---- drawing ---------------------------------------------------------------------------------

_COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "SEND_F": "#bab0ac", "RECV_F": "#bab0ac",
           "SEND_B": "#bab0ac", "RECV_B": "#bab0ac"}


def plot(timeline: Timeline, path: str | Path) -> None:
    """Write a Gantt chart of ``timeline`` to the PNG ``path``: one row per rank (rank 0 on
    top), a box per action of non-zero duration coloured by kind, labelled with its microbatch
    (``mb.chunk`` when a rank holds several stages; chunk ``c`` of rank ``r`` is stage
    ``c * p + r``). Draws on matplotlib's Agg canvas directly, so pyplot's global state and
    the caller's backend are left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sched = timeline.schedule
    p = sched.num_ranks
    fig = Figure(figsize=(max(6.0, 0.35 * float(timeline.makespan) + 1.5), 0.55 * p + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r, entries in enumerate(timeline.ranks):
        for start, end, a in entries:
            if end <= start:
                continue
            ax.barh(r, float(end - start), left=float(start), height=0.8, color=_COLORS[a.kind], edgecolor="black",
                    linewidth=0.4)
            label = f"{a.mb}.{a.stage // p}" if sched.virtual_stages > 1 else f"{a.mb}"
            ax.text(float(start + end) / 2, r, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, max(float(timeline.makespan), 1.0))
    ax.set_xlabel("time")
    ax.set_title(f"{sched.kind}: p={p}, v={sched.virtual_stages}, m={sched.num_microbatches},"
                 f" bubble {float(timeline.bubble):.1%}", loc="left")
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in ("F", "B", "W")], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncols=3, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)


def text(timeline: Timeline) -> str:
    """The timeline as text, one line per rank and three characters per time unit: ``F3`` is
    microbatch 3's forward, ``B3`` its input-gradient backward, ``W3`` its weight-gradient pass,
    ``.`` idle (``F3.1``-style chunk labels are left out: interleaved ranks show the microbatch
    only). Needs integer action durations (the default unit costs); ``ValueError`` otherwise."""
    width = int(timeline.makespan)
    if width != timeline.makespan:
        raise ValueError("text() needs integer durations; use plot() for others")
    lines = []
    for r, entries in enumerate(timeline.ranks):
        cells = [" . "] * width
        for e in entries:
            if e.end == e.start or not isinstance(e.action, (F, B, W)):
                continue
            if e.start != int(e.start) or e.end != int(e.end):
                raise ValueError("text() needs integer durations; use plot() for others")
            for t in range(int(e.start), int(e.end)):
                cells[t] = f"{e.action.kind}{e.action.mb}".ljust(3)
        lines.append(f"rank {r} |" + "".join(cells).rstrip())
    return "\n".join(lines)
