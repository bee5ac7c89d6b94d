"""Properties of a private pipeline's simulated run (``fsdpx.sharding.private_sim``) over every
schedule kind on 1-8 ranks, 1-16 microbatches and 1-3 virtual stages, with exact costs: the
``W``s (clipped sums) run once each, after their norms, only in waits for a message or after the
list, and wherever the policy says they can; the listed actions keep their order."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st
from test_schedule_properties import costs, schedules, transfers

from fsdpx.sharding.private_sim import simulate_private
from fsdpx.sharding.schedule import RECV_B, RECV_F, B, W, matching
from fsdpx.sharding.schedule import schedule as make_schedule
from fsdpx.sharding.schedule_sim import simulate

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


def test_two_ranks_two_microbatches_by_hand():
    """1f1b, p = m = 2, unit costs: rank 0 reaches RECV_B(1) at 4 with microbatch 0's norms
    complete (rank 1's B0 ended at 3, its own at 4), so W0 fills the wait for B1's gradient
    (sent at 5); every other W follows the lists."""
    from fsdpx.sharding.schedule import schedule
    from fsdpx.sharding.schedule_sim import text

    timeline = simulate_private(schedule("1f1b", 2, 2))
    assert text(timeline) == "rank 0 |F0 F1  . B0 W0 B1 W1\nrank 1 | . F0 B0 F1 B1 W0 W1"
    assert timeline.bubble == Fraction(2, 14)
