"""A private pipeline on a clock: its ``W``s where the executor forms them, not where listed.

With book-keeping clipping a stage's weight gradient of one microbatch (its ``W``: the
examples' contributions scaled by their clip factors and summed) needs the examples' complete
norms, so it cannot run right after its ``B``. The executor (``fsdpx.runtime.pipeline``, with a
``DPConfig``) places it by a dynamic policy, which this module runs on the simulator's clock:

* a rank starts the all-reduce of microbatch ``mb``'s squared norms as its last ``B`` of ``mb``
  ends; the norms are complete ``norms`` (the all-reduce's time) after the last rank's start,
  and never before those of ``mb - 1`` (one collective after another);
* the ``W`` actions in the schedule's lists do nothing; each rank forms its ``W``s itself, in
  microbatch order, one microbatch at a time (its stages' ``W``s of it, back to back):
  - at a receive whose message is not in yet, if the next microbatch's norms are complete it
    forms that microbatch, then looks again; once they are not, it waits for the message
    without looking again (a ``W`` started is finished: the message waits for it);
  - after its list, every microbatch left, each as soon as its norms are complete.

Costs are ``simulate``'s (``fsdpx.sharding.schedule_sim``; both run on the clock of
``fsdpx.sharding.schedule_clock``), ``W`` being one stage's clipped sum of one microbatch; so
are transit and shared cores. The timeline's bubble then counts the ``W``s formed in waits as
work and the wait for the last norms as idle. A message, or norms,
arriving at the very instant a rank looks count as in. A pipeline with a parameter two stages
share completes every norm after the lists (one all-reduce): ``norms`` longer than the step
puts every ``W`` there.
"""

from __future__ import annotations

from collections import deque
from numbers import Real
from typing import Mapping, Sequence

from .schedule import RECV_B, RECV_F, Action, B, F, Schedule, W, check, matching
from .schedule_clock import (Deadlock, Entry, Timeline, Transfer, action_work, advance, check_cores, ready_at,
                             timeline_of, transit_delay, waits_for)


def simulate_private(schedule: Schedule, costs: Mapping[str, float] | None = None, *,
                     rank_costs: Sequence[Mapping[str, float]] | None = None,
                     stage_costs: Sequence[Mapping[str, float]] | None = None,
                     transfer: Transfer | None = None, action_costs: Mapping[Action, float] | None = None,
                     norms: Real = 0, cores: int | None = None) -> Timeline:
    """The ``Timeline`` of ``schedule`` run as a private pipeline (module docstring): every
    action but the listed ``W``s in list order, and each ``W(mb, s)`` once, on stage ``s``'s rank,
    where the policy forms it. Arguments as ``simulate``'s (``action_costs`` replays a measured step,
    its ``W(mb, s)`` the clipped sums of ``mb`` at ``s``); ``norms`` is the all-reduce's time.

    Guarantees (``property_tests/test_private_sim_properties.py``):
      * each rank runs its list (``W``s left out) in order and every ``W`` once, never two
        actions at a time; a ``W(mb, s)`` starts no earlier than ``mb``'s norms are complete
        (the last rank's last ``B`` of ``mb`` plus ``norms``), a rank's ``W``s run in microbatch
        order, and each starts either after the rank's list or while the rank waits for a
        receive whose message had not arrived when that microbatch's ``W``s began
        (``test_private_w_runs_after_its_norms_in_a_wait_or_after_the_list``), and a rank
        reaching a receive whose message is not in forms its next microbatch whenever that
        microbatch's norms are complete (``test_private_w_fills_every_wait_it_can``);
      * with ``W`` free the listed actions run exactly as ``simulate`` runs them
        (``test_free_w_leaves_the_schedule_as_simulated``); norms that are never complete in
        time put every ``W`` after the list, which again runs as simulated
        (``test_late_norms_put_every_w_after_the_list``);
      * ``cores >= p`` is a core each, exactly for exact costs
        (``test_private_as_many_cores_as_ranks_changes_nothing``).

    Raises ``ValueError`` as ``simulate`` does, and for negative ``norms``."""
    check(schedule)
    delay = transit_delay(transfer)
    if norms < 0:
        raise ValueError(f"the norms' all-reduce time must be >= 0, got {norms}")
    work = action_work(schedule, costs, rank_costs, stage_costs, action_costs)
    check_cores(cores)
    return timeline_of(schedule, _PrivateRun(schedule, work, delay, norms, cores).run())


def private_held_by_rank(timeline: Timeline, activations: Sequence[Real],
                         contributions: Sequence[Real]) -> tuple[Real, ...]:
    """Per rank, the most a private pipeline's rank holds at once when a microbatch at stage
    ``s`` holds ``activations[s]`` (its forward's graph) from the start of its ``F`` to the end
    of its ``B``, and ``contributions[s]`` (its examples' factors or per-example gradients,
    ``privacy.contributions``) from there to the end of its ``W``, in the order ``timeline``
    (a ``simulate_private`` run) ran them. At a ``B``'s end the one swaps for the other: the
    contributions' input factors are the graph's own saved inputs, and the runtime frees the
    graph as it keeps them (``fsdpx.runtime.pipeline``), so the transient overlap is not
    counted.

    Guarantees (``property_tests/test_private_sim_properties.py``): the result is the most,
    over every instant, of the activations of the microbatches between their ``F``'s start and
    their ``B``'s end plus the contributions of those between their ``B``'s end and their
    ``W``'s end (``test_private_held_is_the_most_held_at_any_instant``); equal weights for both
    give ``peak_held_by_rank``'s count on the executed order, unit weights
    ``timeline.peak_in_flight_by_rank`` (``test_private_held_with_equal_weights_counts_in_flight``).

    Raises ``ValueError`` when either list's length is not the number of stages."""
    stages = timeline.schedule.num_stages
    for label, weights in (("activations", activations), ("contributions", contributions)):
        if len(weights) != stages:
            raise ValueError(f"{label} has {len(weights)} entries for {stages} stages")
    out = []
    for entries in timeline.ranks:
        held = peak = 0
        for e in entries:
            a = e.action
            if isinstance(a, F):
                held += activations[a.stage]
            elif isinstance(a, B):
                held += contributions[a.stage] - activations[a.stage]
            elif isinstance(a, W):
                held -= contributions[a.stage]
            peak = max(peak, held)
        out.append(peak)
    return tuple(out)


class _PrivateRun:
    """The event loop: as ``schedule_sim``'s shared-cores loop (``schedule_clock.advance``:
    processor sharing when ``cores`` is given, a core each otherwise), each idle rank asking
    ``_next`` what it does now."""

    def __init__(self, schedule: Schedule, work, delay: Real, norms: Real, cores: int | None):
        self.schedule, self.work, self.delay, self.norms, self.cores = schedule, work, delay, norms, cores
        p, m = schedule.num_ranks, schedule.num_microbatches
        self.lists = [tuple(a for a in actions if not isinstance(a, W)) for actions in schedule.ranks]
        self.stages = [sorted({a.stage for a in actions if isinstance(a, B)}) for actions in schedule.ranks]
        self.backwards_left = [[len(self.stages[r])] * m for r in range(p)]
        self.started: list[dict[int, Real]] = [{} for _ in range(m)]  # mb -> rank -> its all-reduce's start
        self.complete: list[Real | None] = [None] * m  # when each microbatch's norms are complete
        self.ends: dict[Action, Real] = {}
        self.entries: list[list[Entry]] = [[] for _ in range(p)]
        self.pos, self.free = [0] * p, [0] * p  # next list action, when the rank last finished
        self.next_mb = [0] * p  # the next microbatch whose W's the rank forms
        self.forming: list[deque] = [deque() for _ in range(p)]  # W's of the microbatch being formed
        self.settled = [False] * p  # waiting for the current receive's message without looking again

    def run(self) -> list[list[Entry]]:
        t: Real = 0
        running: dict[int, list] = {}  # rank -> [start, work left, action, work]
        while True:
            # start what may start now (zero-work actions end at once, unblocking more); only
            # then may a rank at a receive decide to form W's, everything ending at t seen
            while True:
                moved, wake = self._pass(t, running, decide=False)
                if not moved:
                    moved, wake = self._pass(t, running, decide=True)
                if not moved:
                    break
            if not running and wake is None:
                break
            t, ended = advance(running, self.cores, t, wake)
            for r, start, a in ended:
                self._end(r, a, start, t)
        self._check_done()
        return self.entries

    def _pass(self, t: Real, running: dict[int, list], *, decide: bool) -> tuple[bool, Real | None]:
        """Each idle rank starts what it may at ``t``: whether a zero-work action ended, and
        the earliest later time an idle rank is to look again (``None``: none known)."""
        moved, wake = False, None
        for r in range(self.schedule.num_ranks):
            if r in running:
                continue
            a, at = self._next(r, t, decide)
            if a is None:
                wake = at if wake is None or (at is not None and at < wake) else wake
                continue
            work = self.work(a)
            if work == 0:
                self._end(r, a, at, at)
                moved = True
            else:
                running[r] = [at, work, a, work]
        return moved, wake

    def _next(self, r: int, t: Real, decide: bool) -> tuple[Action | None, Real | None]:
        """``(action, start)`` for what idle rank ``r`` starts at ``t`` (its start ``<= t``), or
        ``(None, when)``: nothing yet, look again at ``when`` (``None``: when something ends).
        A rank whose message is not in decides whether to form ``W``s only when ``decide``."""
        if self.forming[r]:
            return self.forming[r][0], t
        if self.pos[r] < len(self.lists[r]):
            a = self.lists[r][self.pos[r]]
            deps = waits_for(a, self.schedule)
            if isinstance(a, (RECV_F, RECV_B)):
                send = matching(a, self.schedule.num_ranks)
                arrival = self.ends[send] + self.delay if send in self.ends else None
                if (arrival is None or arrival > t) and not self.settled[r]:
                    if not decide:
                        return None, None
                    if self._norms_ready(r, t):
                        return self._form(r), t
                    self.settled[r] = True
                if arrival is None:
                    return None, None
                start = max(self.free[r], arrival)
                return (a, start) if start <= t else (None, start)
            if any(d not in self.ends for d in deps):
                return None, None
            return a, ready_at(a, deps, self.ends, self.free[r], self.delay)
        if self.next_mb[r] < self.schedule.num_microbatches:
            done = self.complete[self.next_mb[r]]
            if done is None or done > t:
                return None, done
            return self._form(r), t
        return None, None

    def _norms_ready(self, r: int, t: Real) -> bool:
        mb = self.next_mb[r]
        return mb < self.schedule.num_microbatches and self.complete[mb] is not None and self.complete[mb] <= t

    def _form(self, r: int) -> Action:
        """Commit rank ``r`` to its next microbatch's ``W``s; the first of them."""
        mb = self.next_mb[r]
        self.next_mb[r] += 1
        self.forming[r].extend(W(mb, s) for s in self.stages[r])
        return self.forming[r][0]

    def _end(self, r: int, a: Action, start: Real, end: Real) -> None:
        self.entries[r].append(Entry(start, end, a))
        self.ends[a] = self.free[r] = end
        if isinstance(a, W):
            self.forming[r].popleft()
            return
        self.pos[r] += 1
        if isinstance(a, (RECV_F, RECV_B)):
            self.settled[r] = False
        if isinstance(a, B):
            self.backwards_left[r][a.mb] -= 1
            if not self.backwards_left[r][a.mb]:
                self.started[a.mb][r] = end
                self._complete_from(a.mb)

    def _complete_from(self, mb: int) -> None:
        """Fix the completion of ``mb``'s norms and of the later ones this unblocks."""
        m, p = self.schedule.num_microbatches, self.schedule.num_ranks
        while mb < m and self.complete[mb] is None and len(self.started[mb]) == p:
            before = self.complete[mb - 1] if mb else 0
            if before is None:
                return
            self.complete[mb] = max(max(self.started[mb].values()) + self.norms, before)
            mb += 1

    def _check_done(self) -> None:
        stuck = []
        for r, actions in enumerate(self.lists):
            if self.pos[r] < len(actions):
                a = actions[self.pos[r]]
                missing = ", ".join(repr(d) for d in waits_for(a, self.schedule) if d not in self.ends)
                stuck.append(f"rank {r} is stuck at {a!r}, waiting for {missing}")
            elif self.next_mb[r] < self.schedule.num_microbatches or self.forming[r]:
                stuck.append(f"rank {r} never formed the W's of microbatch {self.next_mb[r]} (norms never complete)")
        if stuck:
            raise Deadlock("deadlock, no rank can move:\n  " + "\n  ".join(stuck))
