"""Properties of pipeline schedules and their simulated runs, over every kind on 1-8 ranks, 1-16
microbatches and 1-3 virtual stages: the step is complete and matched, never deadlocks, keeps
each microbatch's F before its B before its W, and has the textbook bubbles and memory with unit
costs (F = B = W = 1, transfers free; a fused backward costs B + W = 2)."""

from collections import Counter
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from fsdpx.sharding.schedule import (
    COMPUTE, P2P, RECV_B, RECV_F, SEND_B, SEND_F, B, F, W, check, matching,
)
from fsdpx.sharding.schedule import schedule as make_schedule
from fsdpx.sharding.schedule_sim import Transfer, peak_held_by_rank, simulate

from support.schedule_cases import MAX_MICROBATCHES, MAX_RANKS, MAX_VIRTUAL, costs, schedules, transfers

def exact_bubble(timeline) -> Fraction:
    """The bubble as a fraction (unit costs keep every time an int)."""
    return Fraction(timeline.idle_time, timeline.schedule.num_ranks * timeline.makespan)


@given(schedules())
def test_every_microbatch_and_stage_has_exactly_one_forward_backward_and_weight_pass(sched):
    check(sched)
    placed = Counter((type(a), a.mb, a.stage, r) for r, actions in enumerate(sched.ranks) for a in actions
                     if isinstance(a, COMPUTE))
    expected = Counter((cls, mb, s, s % sched.num_ranks) for cls in COMPUTE for mb in range(sched.num_microbatches)
                       for s in range(sched.num_stages))
    assert placed == expected


@given(schedules())
def test_every_send_has_exactly_one_matching_receive(sched):
    p = sched.num_ranks
    transfers = Counter(a for actions in sched.ranks for a in actions if isinstance(a, P2P))
    sends = [a for a in transfers if isinstance(a, (SEND_F, SEND_B))]
    receives = [a for a in transfers if isinstance(a, (RECV_F, RECV_B))]
    assert all(n == 1 for n in transfers.values())
    assert len(sends) == len(receives)
    for send in sends:
        assert transfers[matching(send, p)] == 1
        assert matching(matching(send, p), p) == send
    # one activation and one gradient per microbatch across each boundary between ranks, none within a rank
    boundaries = sum(1 for s in range(sched.num_stages - 1) if s % p != (s + 1) % p)
    assert len(sends) == 2 * boundaries * sched.num_microbatches


@given(schedules(), costs)
def test_simulation_never_deadlocks_and_orders_forward_backward_weight(sched, cost):
    timeline = simulate(sched, cost)
    at = timeline.by_action()
    assert [tuple(e.action for e in entries) for entries in timeline.ranks] == list(sched.ranks)
    for entries in timeline.ranks:
        for before, after in zip(entries, entries[1:]):
            assert before.end <= after.start  # one action at a time, in list order
    for mb in range(sched.num_microbatches):
        for s in range(sched.num_stages):
            f, b, w = at[F(mb, s)], at[B(mb, s)], at[W(mb, s)]
            assert f.end <= b.start and b.end <= w.start
            if s > 0:
                assert at[F(mb, s - 1)].end <= f.start
            if s + 1 < sched.num_stages:
                assert at[B(mb, s + 1)].end <= b.start
    for a, e in at.items():
        if isinstance(a, (RECV_F, RECV_B)):
            assert at[matching(a, sched.num_ranks)].end <= e.start
    assert timeline.makespan == max(e.end for e in at.values())


@given(schedules(kinds=("gpipe", "1f1b")))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(sched):
    p, m = sched.num_ranks, sched.num_microbatches
    timeline = simulate(sched)
    assert exact_bubble(timeline) == Fraction(p - 1, m + p - 1)
    assert abs(timeline.bubble - (p - 1) / (m + p - 1)) < 1e-12


@given(schedules(kinds=("interleaved_1f1b",)))
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(sched):
    p, m, v = sched.num_ranks, sched.num_microbatches, sched.virtual_stages
    assert exact_bubble(simulate(sched)) == Fraction(p - 1, v * m + p - 1)


@given(schedules(kinds=("zero_bubble",), at_least_one_round=True))
def test_zero_bubble_idles_p_minus_1_units_per_rank_when_m_at_least_p(sched):
    """ZB-H1's bubble (p - 1)(F + B - W): a third of 1F1B's 3 (p - 1) with unit costs."""
    p, m = sched.num_ranks, sched.num_microbatches
    timeline = simulate(sched)
    assert timeline.makespan == 3 * m + p - 1
    assert exact_bubble(timeline) == Fraction(p - 1, 3 * m + p - 1)


@given(st.integers(1, MAX_RANKS), st.integers(1, MAX_MICROBATCHES))
def test_in_flight_microbatches(p, m):
    """1F1B holds at most p - s microbatches at stage s (so at most p), GPipe all m, and
    ZB-H1 min(p, m) everywhere: never more than 1F1B's peak."""
    one_f_one_b = simulate(make_schedule("1f1b", p, m)).peak_in_flight
    gpipe = simulate(make_schedule("gpipe", p, m)).peak_in_flight
    zero_bubble = simulate(make_schedule("zero_bubble", p, m)).peak_in_flight
    assert one_f_one_b == tuple(min(p - s, m) for s in range(p))
    assert max(one_f_one_b) <= p
    assert gpipe == (m,) * p
    assert zero_bubble == (min(p, m),) * p
    assert max(zero_bubble) <= max(one_f_one_b)


@given(schedules(kinds=("interleaved_1f1b",)))
def test_interleaved_in_flight_chunks_per_rank(sched):
    """Rank r holds at most its warm-up + 1 microbatch-chunks, Megatron's (v - 1) p + 2 (p - 1 - r)
    warm-up (p - 1 - r with v = 1, as 1F1B), and never more than all v m of them."""
    p, m, v = sched.num_ranks, sched.num_microbatches, sched.virtual_stages
    warmup = [(v - 1) * p + 2 * (p - 1 - r) if v > 1 else p - 1 - r for r in range(p)]
    assert simulate(sched).peak_in_flight_by_rank == tuple(min(w + 1, v * m) for w in warmup)


@given(st.integers(2, MAX_RANKS), st.data())
def test_interleaved_and_zero_bubble_bubbles_are_strictly_smaller_than_1f1b(p, data):
    m = data.draw(st.integers(p, MAX_MICROBATCHES), label="m")
    v = data.draw(st.integers(2, MAX_VIRTUAL), label="v")
    one_f_one_b = exact_bubble(simulate(make_schedule("1f1b", p, m)))
    assert exact_bubble(simulate(make_schedule("zero_bubble", p, m))) < one_f_one_b
    m_rounds = m - m % p  # interleaving needs whole rounds of p microbatches
    interleaved = exact_bubble(simulate(make_schedule("interleaved_1f1b", p, m_rounds, virtual_stages=v)))
    assert interleaved < exact_bubble(simulate(make_schedule("1f1b", p, m_rounds)))


@given(schedules(), st.data())
def test_stage_costs_equal_to_rank_costs_give_the_same_timeline(sched, data):
    """Per-stage costs extend per-rank ones: every stage given its rank's costs (or every stage
    one mapping) runs exactly the old timeline, action for action."""
    p = sched.num_ranks
    rank_costs = [data.draw(costs, label=f"rank {r}") for r in range(p)]
    by_rank = simulate(sched, rank_costs=rank_costs)
    by_stage = simulate(sched, stage_costs=[rank_costs[s % p] for s in range(sched.num_stages)])
    assert by_stage.ranks == by_rank.ranks and by_stage.makespan == by_rank.makespan
    assert by_stage.compute_time == by_rank.compute_time
    one = rank_costs[0]
    assert simulate(sched, stage_costs=[one] * sched.num_stages).ranks == simulate(sched, one).ranks


@given(schedules(kinds=("interleaved_1f1b",)), st.data())
def test_each_action_costs_what_its_stage_is_given(sched, data):
    """With distinct costs per stage, every compute action lasts its own stage's cost."""
    stage_costs = [data.draw(costs, label=f"stage {s}") for s in range(sched.num_stages)]
    timeline = simulate(sched, stage_costs=stage_costs)
    for entries in timeline.ranks:
        for e in entries:
            assert e.end - e.start == stage_costs[e.action.stage][e.action.kind]


@given(schedules(), costs, st.data())
def test_zero_transfer_gives_the_timeline_without_one(sched, cost, data):
    """Free transit is the old simulator: every entry, the makespan and the compute time, exactly,
    whichever field is zero."""
    zero = data.draw(st.sampled_from([Transfer(), Transfer(0, 5, 0), Transfer(0, 0, 7)]), label="zero")
    assert zero.delay == 0
    old, new = simulate(sched, cost), simulate(sched, cost, transfer=zero)
    assert new.ranks == old.ranks and new.makespan == old.makespan and new.compute_time == old.compute_time
    assert new.peak_in_flight == old.peak_in_flight


@given(schedules(), costs, transfers)
def test_transit_time_delays_only_receivers(sched, cost, transfer):
    """A message's time in transit ``d`` is paid by its receiver: no action starts earlier than
    with free transit; each rank runs exactly as before up to its first receive (a send never
    waits for its message to arrive); every receive ends at least ``d`` after its send; and the
    makespan grows by at most ``d`` per receive of the step (each path through the schedule
    crosses a receive at most once)."""
    free, slow = simulate(sched, cost), simulate(sched, cost, transfer=transfer)
    d = transfer.delay
    before, after = free.by_action(), slow.by_action()
    for a, e in after.items():
        assert e.start >= before[a].start and e.end >= before[a].end
    for old, new in zip(free.ranks, slow.ranks):
        first = next((i for i, e in enumerate(new) if isinstance(e.action, (RECV_F, RECV_B))), len(new))
        assert new[:first] == old[:first]
    receives = [a for a in after if isinstance(a, (RECV_F, RECV_B))]
    for a in receives:
        assert after[a].start >= after[matching(a, sched.num_ranks)].end + d
    assert slow.makespan <= free.makespan + d * len(receives)
    assert slow.compute_time == free.compute_time


@given(schedules(kinds=("gpipe",)), st.fractions(0, 4, max_denominator=8))
def test_gpipe_makespan_grows_by_one_delay_per_boundary_each_way(sched, d):
    """Unit costs, transit ``d``: the first forward reaches the last rank ``(p - 1)`` transits
    late and the last backward returns ``(p - 1)`` transits later still, nothing else waits."""
    p, m = sched.num_ranks, sched.num_microbatches
    assert simulate(sched, transfer=Transfer(latency=d)).makespan == 3 * (m + p - 1) + 2 * (p - 1) * d


@given(schedules(), st.data())
def test_peak_held_weighs_in_flight_microbatches_by_stage(sched, data):
    """Unit weights count microbatches (``peak_in_flight_by_rank``); with one stage per rank the
    weighted peak is that stage's weight times its peak in flight; never more than every held
    chunk at its rank's largest weight."""
    timeline = simulate(sched)
    assert peak_held_by_rank(sched, [1] * sched.num_stages) == timeline.peak_in_flight_by_rank
    weights = data.draw(st.lists(st.integers(0, 9), min_size=sched.num_stages, max_size=sched.num_stages))
    held = peak_held_by_rank(sched, weights)
    p = sched.num_ranks
    for r in range(p):
        mine = [weights[s] for s in range(r, sched.num_stages, p)]
        assert held[r] <= max(mine) * timeline.peak_in_flight_by_rank[r]
    if sched.virtual_stages == 1:
        assert held == tuple(w * n for w, n in zip(weights, timeline.peak_in_flight))


@given(schedules(), st.data())
def test_action_costs_equal_to_stage_costs_give_the_same_timeline(sched, data):
    """A replay that gives every action (or some of them) the cost its stage and kind give it
    runs exactly the timeline of the stage costs."""
    stage_costs = [data.draw(costs, label=f"stage {s}") for s in range(sched.num_stages)]
    by_stage = simulate(sched, stage_costs=stage_costs)
    actions = [a for actions in sched.ranks for a in actions]
    some = data.draw(st.lists(st.sampled_from(actions), unique=True), label="replayed") if actions else []
    for chosen in (actions, some):
        replay = simulate(sched, stage_costs=stage_costs,
                          action_costs={a: stage_costs[a.stage][a.kind] for a in chosen})
        assert replay.ranks == by_stage.ranks and replay.makespan == by_stage.makespan


def _ordered(timeline, sched) -> None:
    """Each rank runs its list in order, one action at a time, each F before its B before its W."""
    assert [tuple(e.action for e in entries) for entries in timeline.ranks] == list(sched.ranks)
    for entries in timeline.ranks:
        for before, after in zip(entries, entries[1:]):
            assert before.start <= before.end <= after.start
    at = timeline.by_action()
    for mb in range(sched.num_microbatches):
        for s in range(sched.num_stages):
            assert at[F(mb, s)].end <= at[B(mb, s)].start and at[B(mb, s)].end <= at[W(mb, s)].start


@given(schedules(), costs, transfers, st.data())
def test_as_many_cores_as_ranks_changes_nothing(sched, cost, transfer, data):
    """With a core for every rank, sharing never slows a rank: the shared-core event loop gives
    exactly the timeline of a core each (exact costs); with fewer it keeps the schedule's order."""
    cores = data.draw(st.integers(sched.num_ranks, sched.num_ranks + 2), label="cores")
    own, shared = simulate(sched, cost, transfer=transfer), simulate(sched, cost, transfer=transfer, cores=cores)
    assert shared.ranks == own.ranks and shared.makespan == own.makespan
    assert shared.compute_time == own.compute_time
    fewer = simulate(sched, cost, transfer=transfer, cores=data.draw(st.integers(1, sched.num_ranks), label="c"))
    _ordered(fewer, sched)


@given(schedules(), costs)
def test_one_core_runs_the_total_work_back_to_back(sched, cost):
    """Free transit, one core: some rank can always move (no deadlock), so the core never idles
    and the makespan is the step's total work."""
    own = simulate(sched, cost)
    work = sum(e.end - e.start for entries in own.ranks for e in entries)
    assert simulate(sched, cost, cores=1).makespan == work


@given(schedules(), costs, transfers, st.data())
def test_shared_cores_stretch_the_timeline_by_at_most_p_over_c(sched, cost, transfer, data):
    """Each running action advances at between ``c / p`` and 1 of a core: no action ends earlier
    than with a core per rank nor later than that timeline stretched by ``p / c``; the makespan
    is at least the work over ``c``; waiting for a core counts as computing."""
    p = sched.num_ranks
    c = data.draw(st.integers(1, p), label="cores")
    own, shared = simulate(sched, cost, transfer=transfer), simulate(sched, cost, transfer=transfer, cores=c)
    before, after = own.by_action(), shared.by_action()
    for a, e in after.items():
        assert before[a].end <= e.end <= before[a].end * Fraction(p, c)
    work = sum(e.end - e.start for entries in own.ranks for e in entries)
    assert max(own.makespan, Fraction(work, c)) <= shared.makespan <= own.makespan * Fraction(p, c)
    assert shared.compute_time >= own.compute_time
