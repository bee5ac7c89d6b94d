"""Properties of a private pipeline's simulated run (``fsdpx.sharding.private_sim``) over every
schedule kind on 1-8 ranks, 1-16 microbatches and 1-3 virtual stages, with exact costs: the
``W``s (clipped sums) run once each, after their norms, only in waits for a message or after the
list, and wherever the policy says they can; the listed actions keep their order."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from fsdpx.sharding.private_sim import private_held_by_rank, simulate_private
from fsdpx.sharding.schedule import RECV_B, RECV_F, B, W, matching
from fsdpx.sharding.schedule import schedule as make_schedule
from fsdpx.sharding.schedule_sim import peak_held_by_rank, simulate

from support.schedule_cases import costs, schedules, transfers

norms_times = st.fractions(0, 4, max_denominator=4)


def _stages(sched, r: int) -> list[int]:
    return sorted({a.stage for a in sched.ranks[r] if isinstance(a, B)})


def _complete(timeline, sched, norms) -> list:
    """When each microbatch's norms are complete: its last ``B`` anywhere plus ``norms``, and
    never before the previous microbatch's."""
    at, out, before = timeline.by_action(), [], 0
    for mb in range(sched.num_microbatches):
        before = max(before, max(at[B(mb, s)].end for s in range(sched.num_stages)) + norms)
        out.append(before)
    return out


def _groups(entries) -> list[tuple[int, int, int]]:
    """Each microbatch's ``W``s on one rank: ``(mb, index of its first W, index after its last)``."""
    out, i = [], 0
    while i < len(entries):
        if isinstance(entries[i].action, W):
            j = i
            while j < len(entries) and isinstance(entries[j].action, W) and entries[j].action.mb == entries[i].action.mb:
                j += 1
            out.append((entries[i].action.mb, i, j))
            i = j
        else:
            i += 1
    return out


def _arrival(timeline, sched, receive, delay):
    return timeline.by_action()[matching(receive, sched.num_ranks)].end + delay


@given(schedules(), costs, transfers, norms_times)
def test_private_w_runs_after_its_norms_in_a_wait_or_after_the_list(sched, cost, transfer, norms):
    timeline = simulate_private(sched, cost, transfer=transfer, norms=norms)
    complete = _complete(timeline, sched, norms)
    for r, entries in enumerate(timeline.ranks):
        listed = [a for a in sched.ranks[r] if not isinstance(a, W)]
        assert [e.action for e in entries if not isinstance(e.action, W)] == listed
        assert [e.action for e in entries if isinstance(e.action, W)] == \
            [W(mb, s) for mb in range(sched.num_microbatches) for s in _stages(sched, r)]
        for before, after in zip(entries, entries[1:]):
            assert before.start <= before.end <= after.start
        for mb, i, j in _groups(entries):
            begun = entries[i].start
            assert begun >= complete[mb]
            after = [e.action for e in entries[j:] if not isinstance(e.action, W)]
            if after:  # inside the list: the rank was waiting for a message not yet in
                a = after[0]
                assert isinstance(a, (RECV_F, RECV_B))
                assert _arrival(timeline, sched, a, transfer.delay) > begun


@given(schedules(), costs, transfers, norms_times)
def test_private_w_fills_every_wait_it_can(sched, cost, transfer, norms):
    """Not lazy: a rank reaching a receive whose message is not in forms its next microbatch's
    ``W``s if their norms are complete, and after its list forms each microbatch as soon as its
    norms are complete."""
    timeline = simulate_private(sched, cost, transfer=transfer, norms=norms)
    complete = _complete(timeline, sched, norms)
    for r, entries in enumerate(timeline.ranks):
        formed = 0
        for k, e in enumerate(entries):
            if isinstance(e.action, W):
                if e.action.stage == _stages(sched, r)[0]:
                    formed += 1
                continue
            if not isinstance(e.action, (RECV_F, RECV_B)) or k == 0:
                continue
            reached = entries[k - 1].end
            waited = _arrival(timeline, sched, e.action, transfer.delay) > reached
            if waited and formed < sched.num_microbatches and not isinstance(entries[k - 1].action, W):
                assert complete[formed] > reached, (r, e.action, reached)
        last_listed = max(k for k, e in enumerate(entries) if not isinstance(e.action, W))
        for mb, i, _ in _groups(entries):
            if i > last_listed:
                assert entries[i].start == max(entries[i - 1].end, complete[mb])


@given(schedules(), costs, transfers, norms_times)
def test_free_w_leaves_the_schedule_as_simulated(sched, cost, transfer, norms):
    """``W`` costing nothing, the listed actions run exactly where ``simulate`` runs them."""
    cost = {**cost, "W": 0}
    private = simulate_private(sched, cost, transfer=transfer, norms=norms)
    plain = simulate(sched, cost, transfer=transfer)
    for mine, theirs in zip(private.ranks, plain.ranks):
        assert [e for e in mine if not isinstance(e.action, W)] == [e for e in theirs if not isinstance(e.action, W)]


@given(schedules(), costs, transfers)
def test_late_norms_put_every_w_after_the_list(sched, cost, transfer):
    """Norms complete only after every list could end: no ``W`` fills a wait, the list runs as
    ``simulate`` runs it with ``W`` free, and the ``W``s follow it."""
    free = simulate(sched, {**cost, "W": 0}, transfer=transfer)
    late = free.makespan + 1
    timeline = simulate_private(sched, cost, transfer=transfer, norms=late)
    for mine, theirs in zip(timeline.ranks, free.ranks):
        listed = [e for e in mine if not isinstance(e.action, W)]
        assert listed == [e for e in theirs if not isinstance(e.action, W)]
        assert all(isinstance(e.action, W) for e in mine[len(listed):])
        assert all(e.start >= late for e in mine[len(listed):])


@given(schedules(), costs, transfers, norms_times, st.data())
def test_private_as_many_cores_as_ranks_changes_nothing(sched, cost, transfer, norms, data):
    cores = data.draw(st.integers(sched.num_ranks, sched.num_ranks + 2), label="cores")
    own = simulate_private(sched, cost, transfer=transfer, norms=norms)
    shared = simulate_private(sched, cost, transfer=transfer, norms=norms, cores=cores)
    assert shared.ranks == own.ranks and shared.makespan == own.makespan


@given(schedules(), costs, transfers, norms_times)
def test_a_private_rank_holds_a_microbatch_from_its_f_to_its_w(sched, cost, transfer, norms):
    """The timeline's in-flight peak per rank is the most microbatches whose ``F`` has started
    and whose ``W`` has not ended at any instant, ``W``s where the policy formed them."""
    timeline = simulate_private(sched, cost, transfer=transfer, norms=norms)
    for r, entries in enumerate(timeline.ranks):
        f_starts = [e.start for e in entries if e.action.kind == "F"]
        w_ends = [e.end for e in entries if e.action.kind == "W"]
        at_most = max((sum(t >= f for f in f_starts) - sum(t >= w for w in w_ends) for t in f_starts), default=0)
        assert timeline.peak_in_flight_by_rank[r] == at_most


@given(st.integers(2, 8), st.data())
def test_a_private_1f1b_with_equal_costs_holds_every_microbatch(p, data):
    """Equal costs: no 1f1b rank waits in its steady state, so none forms a ``W`` before its
    cool-down and each holds all ``m`` microbatches' contributions, where a plain 1f1b holds
    ``p - r`` microbatches' activations at rank ``r``."""
    m = data.draw(st.integers(p, 16), label="m")
    sched = make_schedule("1f1b", p, m)
    assert simulate_private(sched).peak_in_flight_by_rank == (m,) * p
    assert simulate(sched).peak_in_flight_by_rank == tuple(p - r for r in range(p))


weights = st.integers(0, 9)


@given(schedules(), costs, transfers, norms_times, st.data())
def test_private_held_is_the_most_held_at_any_instant(sched, cost, transfer, norms, data):
    """At every instant a rank holds its microbatches' activations from ``F``'s start to
    ``B``'s end and their contributions from ``B``'s end to ``W``'s end (half-open, a ``B``'s end
    swapping the one for the other); the peak is the most of that over the instants where
    holdings grow."""
    timeline = simulate_private(sched, cost, transfer=transfer, norms=norms)
    n = sched.num_stages
    act = data.draw(st.lists(weights, min_size=n, max_size=n), label="activations")
    con = data.draw(st.lists(weights, min_size=n, max_size=n), label="contributions")
    held = private_held_by_rank(timeline, act, con)
    for r, entries in enumerate(timeline.ranks):
        at = {(e.action.kind, e.action.mb, e.action.stage): e for e in entries if e.action.kind in "FBW"}
        keys = [(mb, s) for (kind, mb, s) in at if kind == "F"]
        order = {id(e): i for i, e in enumerate(entries)}

        def holding(i: int) -> int:  # just after the i-th entry of the rank starts (F) or ends (B)
            total = 0
            for mb, s in keys:
                f, b, w = (order[id(at[(k, mb, s)])] for k in "FBW")
                total += act[s] if f <= i < b else con[s] if b <= i < w else 0
            return total
        assert held[r] == max((holding(i) for i in range(len(entries))), default=0)


@given(schedules(), costs, transfers, norms_times, st.data())
def test_private_held_with_equal_weights_counts_in_flight(sched, cost, transfer, norms, data):
    """Unit weights count the microbatches in flight as the timeline does; equal weights on a
    plain run (``W`` where listed) give ``peak_held_by_rank``."""
    timeline = simulate_private(sched, cost, transfer=transfer, norms=norms)
    ones = [1] * sched.num_stages
    assert private_held_by_rank(timeline, ones, ones) == timeline.peak_in_flight_by_rank
    w = data.draw(st.lists(weights, min_size=sched.num_stages, max_size=sched.num_stages), label="weights")
    assert private_held_by_rank(simulate(sched, cost, transfer=transfer), w, w) == peak_held_by_rank(sched, w)


def test_private_held_by_hand_and_bad_lengths():
    """1f1b, p = m = 2, unit costs (``W`` placement below): rank 0 runs F0 F1 B0 W0 B1 W1, so it
    holds at most ``max(2a, a + c)``; rank 1 runs F0 B0 F1 B1 W0 W1, at most ``2c`` for
    ``c >= a``."""
    import pytest

    timeline = simulate_private(make_schedule("1f1b", 2, 2))
    assert private_held_by_rank(timeline, [3, 3], [5, 5]) == (8, 10)
    assert private_held_by_rank(timeline, [5, 5], [1, 1]) == (10, 6)
    with pytest.raises(ValueError, match="contributions has 1 entries for 2 stages"):
        private_held_by_rank(timeline, [1, 1], [1])


def test_two_ranks_two_microbatches_by_hand():
    """1f1b, p = m = 2, unit costs: rank 0 reaches RECV_B(1) at 4 with microbatch 0's norms
    complete (rank 1's B0 ended at 3, its own at 4), so W0 fills the wait for B1's gradient
    (sent at 5); every other W follows the lists."""
    from fsdpx.sharding.schedule import schedule
    from fsdpx.sharding.schedule_sim import text

    timeline = simulate_private(schedule("1f1b", 2, 2))
    assert text(timeline) == "rank 0 |F0 F1  . B0 W0 B1 W1\nrank 1 | . F0 B0 F1 B1 W0 W1"
    assert timeline.bubble == Fraction(2, 14)
