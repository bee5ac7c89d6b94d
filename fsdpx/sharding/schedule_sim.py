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

The rules above (what an action waits for, its cost, processor sharing) and the ``Timeline``
with its definitions (``makespan``, ``idle_time``, ``bubble``, ``peak_in_flight``) live in
``fsdpx.sharding.schedule_clock``, which the private pipeline's simulator
(``fsdpx.sharding.private_sim``) runs on too.

A schedule where no rank can move raises ``Deadlock`` naming each blocked rank, the action it
is stuck at and what that action waits for. ``plot(timeline, path)`` draws the Gantt chart.
"""

from __future__ import annotations

from collections import deque
from numbers import Real
from pathlib import Path
from typing import Mapping, Sequence

from .schedule import Action, B, F, Schedule, W, check
# Deadlock, Timeline and Transfer are simulate's own vocabulary: callers import them from here too
from .schedule_clock import (Deadlock, Entry, Timeline, Transfer, action_work, advance, check_cores, peak_held,
                             ready_at, timeline_of, transit_delay, waits_for)


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
    delay = transit_delay(transfer)
    work = action_work(schedule, costs, rank_costs, stage_costs, action_costs)
    check_cores(cores)
    if cores is None:
        entries = _run_core_each(schedule, work, delay)
    else:
        entries = _run_shared(schedule, work, delay, cores)
    return timeline_of(schedule, entries)


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
            deps = waits_for(a, schedule)
            missing = next((d for d in deps if d not in ends), None)
            if missing is not None:
                blocked_on.setdefault(missing, []).append(r)
                break
            start = ready_at(a, deps, ends, free[r], delay)
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
                deps = waits_for(a, schedule)
                if any(d not in ends for d in deps):
                    continue
                ready, cost = ready_at(a, deps, ends, free[r], delay), work(a)
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
        t, ended = advance(running, cores, t, arrival)
        for r, start, a in ended:
            entries[r].append(Entry(start, t, a))
            ends[a] = free[r] = t
    if any(len(e) < len(a) for e, a in zip(entries, schedule.ranks)):
        raise Deadlock(_deadlock_message(schedule, entries, ends))
    return entries


def _deadlock_message(schedule: Schedule, entries: list[list[Entry]], ends: Mapping[Action, float]) -> str:
    lines = []
    for r, actions in enumerate(schedule.ranks):
        if len(entries[r]) < len(actions):
            a = actions[len(entries[r])]
            missing = ", ".join(repr(d) for d in waits_for(a, schedule) if d not in ends)
            lines.append(f"rank {r} is stuck at {a!r} (action {len(entries[r])} of {len(actions)}),"
                         f" waiting for {missing}")
    return "deadlock, no rank can move:\n  " + "\n  ".join(lines)


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches whose ``F`` has started and whose ``W`` has not ended
    (see the module docstring); a pure function of the schedule. 1f1b keeps at most
    ``p - s`` at stage ``s``, gpipe all ``m``, zero_bubble at most ``p``
    (``test_in_flight_microbatches``)."""
    return tuple(
        peak_held(schedule.ranks[schedule.rank_of(s)], lambda a, s=s: a.stage == s) for s in range(schedule.num_stages)
    )


def peak_held_by_rank(schedule: Schedule, per_stage: Sequence[Real]) -> tuple[Real, ...]:
    """Per rank, the most it holds at once when a microbatch at stage ``s`` holds
    ``per_stage[s]`` (the bytes its activations keep, say) from the start of its ``F`` to the end
    of its ``W``. All ones give ``peak_in_flight_by_rank``; with one stage per rank, ``per_stage``
    times ``peak_in_flight`` (``test_peak_held_weighs_in_flight_microbatches_by_stage``)."""
    if len(per_stage) != schedule.num_stages:
        raise ValueError(f"per_stage has {len(per_stage)} entries for {schedule.num_stages} stages")
    return tuple(peak_held(actions, lambda a: True, per_stage) for actions in schedule.ranks)


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
