"""Random pipeline schedules and costs for the property tests of the schedules and their
simulated runs: every kind on 1-8 ranks, 1-16 microbatches and 1-3 virtual stages."""

from hypothesis import strategies as st

from fsdpx.sharding.schedule import INTERLEAVED, KINDS
from fsdpx.sharding.schedule import schedule as make_schedule
from fsdpx.sharding.schedule_sim import Transfer

MAX_RANKS, MAX_MICROBATCHES, MAX_VIRTUAL = 8, 16, 3


@st.composite
def schedules(draw, kinds=KINDS, min_ranks=1, at_least_one_round=False):
    """A valid schedule: interleaved gets ``m`` a multiple of ``p``, the others any ``m``
    (at least ``p`` with ``at_least_one_round``)."""
    kind = draw(st.sampled_from(kinds))
    p = draw(st.integers(min_ranks, MAX_RANKS))
    if kind in INTERLEAVED:
        v = draw(st.integers(1, MAX_VIRTUAL))
        m = p * draw(st.integers(1, MAX_MICROBATCHES // p))
    else:
        v = 1
        m = draw(st.integers(p if at_least_one_round else 1, MAX_MICROBATCHES))
    return make_schedule(kind, p, m, virtual_stages=v)


# each action kind's cost, integers so that every simulated time is exact
costs = st.fixed_dictionaries({
    "F": st.integers(1, 3), "B": st.integers(1, 3), "W": st.integers(0, 3),
    "SEND_F": st.integers(0, 2), "RECV_F": st.integers(0, 2), "SEND_B": st.integers(0, 2), "RECV_B": st.integers(0, 2),
})

# a link's latency, seconds per byte and message size, exact fractions
transfers = st.builds(Transfer, latency=st.fractions(0, 3, max_denominator=4),
                      seconds_per_byte=st.fractions(0, 1, max_denominator=4), message_bytes=st.integers(0, 4))
