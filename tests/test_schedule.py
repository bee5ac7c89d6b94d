"""Pipeline schedules by example: 1F1B's action lists on two ranks written out, where each kind
sends its gradient, looped placement, timelines worked out by hand, the errors for bad input,
broken schedules and deadlocks, and the Gantt chart."""

import pytest

from fsdpx.sharding.schedule import (
    RECV_B, RECV_F, SEND_B, SEND_F, B, F, Schedule, W, check, schedule,
)
from fsdpx.sharding.schedule_sim import Deadlock, Transfer, plot, simulate


def test_actions_are_hashable_values_with_readable_reprs():
    assert repr(F(3, 1)) == "F(mb=3, stage=1)"
    assert repr(SEND_F(mb=0, stage=0, peer=1)) == "SEND_F(mb=0, stage=0, peer=1)"
    assert F(0, 0) == F(0, 0) and F(0, 0) != B(0, 0)
    assert len({F(0, 0), F(0, 0), B(0, 0), W(0, 0)}) == 3
    with pytest.raises(AttributeError):
        F(0, 0).mb = 1


def test_1f1b_on_two_ranks_and_four_microbatches_is_the_textbook_list():
    s = schedule("1f1b", 2, 4)
    assert (s.kind, s.num_stages, s.num_microbatches, s.num_ranks, s.virtual_stages) == ("1f1b", 2, 4, 2, 1)
    # rank 0: one warm-up forward, then F/B pairs, then the last backward
    assert s.ranks[0] == (
        F(0, 0), SEND_F(0, 0, 1),
        F(1, 0), SEND_F(1, 0, 1), RECV_B(0, 0, 1), B(0, 0), W(0, 0),
        F(2, 0), SEND_F(2, 0, 1), RECV_B(1, 0, 1), B(1, 0), W(1, 0),
        F(3, 0), SEND_F(3, 0, 1), RECV_B(2, 0, 1), B(2, 0), W(2, 0),
        RECV_B(3, 0, 1), B(3, 0), W(3, 0),
    )
    # rank 1, the last stage: no warm-up; the fused backward sends its gradient after the W
    assert s.ranks[1] == tuple(
        a for mb in range(4) for a in (RECV_F(mb, 1, 0), F(mb, 1), B(mb, 1), W(mb, 1), SEND_B(mb, 1, 0))
    )
    assert s.describe().splitlines()[1:] == [
        "  rank 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "  rank 1: F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3",
    ]


def test_gpipe_runs_every_forward_first():
    assert schedule("gpipe", 2, 3).compute(0) == (
        F(0, 0), F(1, 0), F(2, 0), B(0, 0), W(0, 0), B(1, 0), W(1, 0), B(2, 0), W(2, 0),
    )


def test_zero_bubble_sends_the_gradient_before_the_deferred_weight_pass():
    s = schedule("zero_bubble", 2, 3)
    # rank 1 runs its W's one backward late; its gradient leaves right after each B
    assert s.ranks[1] == (
        RECV_F(0, 1, 0), F(0, 1), B(0, 1), SEND_B(0, 1, 0),
        RECV_F(1, 1, 0), F(1, 1), B(1, 1), SEND_B(1, 1, 0), W(0, 1),
        RECV_F(2, 1, 0), F(2, 1), B(2, 1), SEND_B(2, 1, 0), W(1, 1),
        W(2, 1),
    )


def test_interleaved_places_stage_s_on_rank_s_mod_p():
    s = schedule("interleaved_1f1b", 2, 4, virtual_stages=2)
    assert (s.num_stages, s.num_ranks, s.virtual_stages) == (4, 2, 2)
    assert {a.stage for a in s.ranks[0]} == {0, 2}
    assert {a.stage for a in s.ranks[1]} == {1, 3}
    # forwards in rounds of p microbatches through chunk 0, then chunk 1
    assert [a for a in s.compute(0) if isinstance(a, F)] == [
        F(0, 0), F(1, 0), F(0, 2), F(1, 2), F(2, 0), F(3, 0), F(2, 2), F(3, 2),
    ]
    one_rank = schedule("interleaved_1f1b", 1, 2, virtual_stages=3)  # neighbours on one rank exchange nothing
    assert all(isinstance(a, (F, B, W)) for a in one_rank.ranks[0])


def test_interleaved_with_one_virtual_stage_is_1f1b():
    assert schedule("interleaved_1f1b", 4, 8).ranks == schedule("1f1b", 4, 8).ranks


@pytest.mark.parametrize(
    "kind, makespan, bubble",
    [
        ("gpipe", 15, 1 / 5),  # 3 m + 3 (p - 1): (p - 1) / (m + p - 1)
        ("1f1b", 15, 1 / 5),
        ("zero_bubble", 13, 1 / 13),  # 3 m + (p - 1)
    ],
)
def test_unit_cost_timelines_on_two_ranks_and_four_microbatches(kind, makespan, bubble):
    t = simulate(schedule(kind, 2, 4))
    assert t.makespan == makespan
    assert t.compute_time == 2 * 4 * 3
    assert t.bubble == pytest.approx(bubble, abs=1e-12)


def test_one_microbatch_with_a_costly_activation_transfer_by_hand():
    # rank 0: F [0, 1]; rank 1: RECV_F [1, 2], F [2, 3], B [3, 4], W [4, 5]; rank 0: B [5, 6], W [6, 7]
    t = simulate(schedule("gpipe", 2, 1), {"RECV_F": 1})
    at = t.by_action()
    assert at[RECV_F(0, 1, 0)][:2] == (1, 2)
    assert at[B(0, 0)][:2] == (5, 6)
    assert (t.makespan, t.compute_time, t.idle_time) == (7, 6, 8)
    assert t.peak_in_flight == (1, 1) and t.peak_in_flight_by_rank == (1, 1)


def test_one_microbatch_with_a_message_in_transit_by_hand():
    # transit 2 + 4 bytes x 0.25 = 3: rank 0 sends at 1 and goes on; rank 1's receive ends at 4,
    # F [4, 5], B [5, 6], W [6, 7], send at 7; rank 0's receive ends at 10: B [10, 11], W [11, 12]
    t = simulate(schedule("gpipe", 2, 1), transfer=Transfer(latency=2, seconds_per_byte=0.25, message_bytes=4))
    at = t.by_action()
    assert at[SEND_F(0, 0, 1)][:2] == (1, 1) and at[RECV_F(0, 1, 0)][:2] == (4, 4)
    assert at[RECV_B(0, 0, 1)][:2] == (10, 10) and at[B(0, 0)][:2] == (10, 11)
    assert (t.makespan, t.compute_time) == (12, 6)
    with pytest.raises(ValueError, match="delay must be >= 0"):
        simulate(schedule("gpipe", 2, 1), transfer=Transfer(latency=-1))


def test_zero_costs_give_an_empty_timeline_without_dividing_by_zero():
    t = simulate(schedule("1f1b", 3, 2), {"F": 0, "B": 0, "W": 0})
    assert (t.makespan, t.bubble) == (0, 0.0)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("pipedream", 2, 4), {}, ValueError, "unknown schedule kind 'pipedream'; kinds are"),
        (("1f1b", 0, 4), {}, ValueError, "num_stages must be at least 1"),
        (("1f1b", 2, 0), {}, ValueError, "num_microbatches must be at least 1"),
        (("interleaved_1f1b", 2, 4), {"virtual_stages": 0}, ValueError, "virtual_stages must be at least 1"),
        (("1f1b", 2, 4), {"virtual_stages": 2}, ValueError, "needs an interleaved kind"),
        (("zero_bubble", 2, 4), {"virtual_stages": 2}, ValueError, "needs an interleaved kind"),
        (("interleaved_1f1b", 4, 6), {"virtual_stages": 2}, ValueError, "a multiple of num_stages"),
        (("interleaved_1f1b", 4, 2), {"virtual_stages": 2}, ValueError, "so at least 4"),
        (("1f1b", 2.0, 4), {}, TypeError, "num_stages must be an int"),
    ],
)
def test_bad_arguments_name_the_problem(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        schedule(*args, **kwargs)


def test_bad_costs_are_refused():
    s = schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        simulate(s, {"X": 1})
    with pytest.raises(ValueError, match="cost of F must be >= 0"):
        simulate(s, {"F": -1})
    with pytest.raises(ValueError, match="action costs must be >= 0"):
        simulate(s, action_costs={F(0, 0): -1})


def test_check_refuses_incomplete_or_mismatched_schedules():
    good = schedule("1f1b", 2, 1)
    r0, r1 = good.ranks
    with pytest.raises(ValueError, match=r"W\(mb=0, stage=0\) is missing"):
        check(Schedule("1f1b", 2, 1, (tuple(a for a in r0 if a != W(0, 0)), r1)))
    with pytest.raises(ValueError, match="has no matching"):
        check(Schedule("1f1b", 2, 1, (tuple(a for a in r0 if not isinstance(a, RECV_B)), r1)))
    with pytest.raises(ValueError, match="lives on rank 1"):
        check(Schedule("1f1b", 2, 1, (r0 + (F(0, 1),), r1)))
    with pytest.raises(ValueError, match="appears twice"):
        check(Schedule("1f1b", 2, 1, (r0 + (W(0, 0),), r1)))
    with pytest.raises(ValueError, match="do not spread evenly"):
        Schedule("1f1b", 3, 1, (r0, r1))


def test_a_schedule_whose_ranks_wait_on_each_other_deadlocks_with_a_message_naming_them():
    s = schedule("1f1b", 2, 1)
    backward_first = (RECV_B(0, 0, 1), B(0, 0), W(0, 0), F(0, 0), SEND_F(0, 0, 1))  # waits for its own forward
    with pytest.raises(Deadlock) as err:
        simulate(Schedule("1f1b", 2, 1, (backward_first, s.ranks[1])))
    message = str(err.value)
    assert "rank 0 is stuck at RECV_B(mb=0, stage=0, peer=1)" in message
    assert "waiting for SEND_B(mb=0, stage=1, peer=0)" in message
    assert "rank 1 is stuck at RECV_F(mb=0, stage=1, peer=0)" in message
    assert "waiting for SEND_F(mb=0, stage=0, peer=1)" in message


def test_a_backward_listed_before_its_receive_waits_for_it_and_deadlocks():
    r0, r1 = schedule("1f1b", 2, 1).ranks
    early_backward = (F(0, 0), SEND_F(0, 0, 1), B(0, 0), RECV_B(0, 0, 1), W(0, 0))
    stuck = r"rank 0 is stuck at B\(mb=0, stage=0\).*waiting for RECV_B\(mb=0, stage=0, peer=1\)"
    with pytest.raises(Deadlock, match=stuck):
        simulate(Schedule("1f1b", 2, 1, (early_backward, r1)))


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "gantt.png"
    plot(simulate(schedule("interleaved_1f1b", 2, 4, virtual_stages=2)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_draws_one_line_per_rank_with_idle_units():
    from fsdpx.sharding.schedule_sim import text

    assert text(simulate(schedule("gpipe", 2, 2))) == (
        "rank 0 |F0 F1  .  .  . B0 W0 B1 W1\n"
        "rank 1 | . F0 F1 B0 W0 B1 W1  .  .")  # a fused backward sends after its W
    with pytest.raises(ValueError, match="integer"):
        text(simulate(schedule("gpipe", 2, 2), {"F": 0.5}))


def test_rank_costs_make_the_slowest_stage_set_the_pace():
    """1F1B, 2 ranks, 4 microbatches, rank 1 twice as slow: after rank 0's first forward, rank 1
    never idles, and the step ends with rank 0's last backward."""
    t = simulate(schedule("1f1b", 2, 4), rank_costs=[{"F": 1, "B": 1, "W": 1}, {"F": 2, "B": 2, "W": 2}])
    busy = [e for e in t.ranks[1] if e.end > e.start]
    assert busy[0].start == 1 and all(a.end == b.start for a, b in zip(busy, busy[1:])) and busy[-1].end == 25
    assert t.makespan == 25 + 2
    with pytest.raises(ValueError, match="rank_costs"):
        simulate(schedule("1f1b", 2, 4), rank_costs=[{}])


def test_stage_costs_price_an_interleaved_rank_s_chunks_apart():
    """Interleaved on 2 ranks (stages 0, 2 on rank 0; 1, 3 on rank 1), 2 microbatches, every
    action of stage s costing (2, 1, 2, 3)[s]: the last stage (the LM head) is the slow one.
    Rank 1's mean, 2 per action, hides that its second chunk is three times its first:
    priced per rank the step takes 30, priced per stage 36 (rank 1 runs its heavy chunk's
    F, B, W of microbatch 0 back to back while rank 0 waits for the gradient)."""
    sched = schedule("interleaved_1f1b", 2, 2, virtual_stages=2)
    per_stage = [{"F": c, "B": c, "W": c} for c in (2, 1, 2, 3)]
    t = simulate(sched, stage_costs=per_stage)
    for e in (e for entries in t.ranks for e in entries if isinstance(e.action, (F, B, W))):
        assert e.end - e.start == (2, 1, 2, 3)[e.action.stage]
    assert t.makespan == 36
    two = {"F": 2, "B": 2, "W": 2}
    by_rank = simulate(sched, rank_costs=[two, two])
    assert by_rank.compute_time == t.compute_time == 2 * 3 * (2 + 1 + 2 + 3)
    assert by_rank.makespan == 30
    with pytest.raises(ValueError, match="stage_costs"):
        simulate(sched, stage_costs=per_stage[:3])


def test_two_ranks_on_one_core_share_it_while_both_compute():
    """gpipe, 2 ranks, 2 microbatches, unit costs, one core: rank 0's second forward and rank 1's
    first start together at 1 and each gets half the core, so both end at 3; the whole step is
    its 12 units of work back to back, against 9 with a core each."""
    sched = schedule("gpipe", 2, 2)
    t = simulate(sched, cores=1)
    at = t.by_action()
    assert at[F(0, 0)][:2] == (0, 1)
    assert at[F(1, 0)][:2] == (1, 3) and at[F(0, 1)][:2] == (1, 3)
    assert t.makespan == 12 and simulate(sched).makespan == 9
    # the time a rank waits for the core inside an action counts as computing: three times two
    # unit actions share the core for 2 units each, so 12 units of work take 18 rank-units
    assert t.compute_time == 18 and simulate(sched).compute_time == 12
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cores"):
            simulate(sched, cores=bad)
