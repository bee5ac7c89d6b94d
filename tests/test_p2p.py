"""Point-to-point exchanges (pipeline stages) on the simulated mesh: in order, counted, and a
silent peer is named instead of waited for."""

import time

import pytest
import torch

from fsdpx.runtime.threads import run_threads
from fsdpx.sharding import Mesh, RankFailure


def test_messages_arrive_in_order_both_ways_at_once_and_are_counted():
    def rank(comm):
        me, peer = comm.rank, 1 - comm.rank
        first = torch.full((2, 3), float(me))
        second = torch.arange(4.0) + 10 * me
        a, b = comm.exchange_p2p([(peer, first), (peer, second)], [(peer, (2, 3), torch.float32), (peer, (4,), torch.float32)])
        return a, b, comm.counts()

    (a0, b0, counts), (a1, b1, _) = run_threads(Mesh(pp=2), rank)
    assert torch.equal(a0, torch.full((2, 3), 1.0)) and torch.equal(b0, torch.arange(4.0) + 10)
    assert torch.equal(a1, torch.zeros(2, 3)) and torch.equal(b1, torch.arange(4.0))
    assert counts["p2p"] == counts["send_bytes"] == counts["recv_bytes"] == (6 + 4) * 4  # rank 0's


def test_a_received_message_is_the_senders_value_not_an_alias():
    def rank(comm):
        if comm.rank == 0:
            t = torch.ones(3)
            comm.exchange_p2p([(1, t)], [])
            t.add_(5)  # changing it after the send changes nothing the peer received
            return None
        return comm.exchange_p2p([], [(0, (3,), torch.float32)])[0]

    assert torch.equal(run_threads(Mesh(pp=2), rank)[1], torch.ones(3))


def test_a_peer_that_never_sends_is_named_within_the_timeout():
    def rank(comm):
        if comm.rank == 1:
            return comm.exchange_p2p([], [(0, (1,), torch.float32)])
        return None  # rank 0 finishes without sending

    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_threads(Mesh(pp=2), rank, timeout=1.0)
    assert err.value.ranks == [0] and time.monotonic() - start < 10


def test_a_peer_that_fails_wakes_its_receiver_at_once():
    def rank(comm):
        if comm.rank == 0:
            raise ValueError("stage 0 broke")
        return comm.exchange_p2p([], [(0, (1,), torch.float32)])

    start = time.monotonic()
    with pytest.raises(ValueError, match="stage 0 broke"):
        run_threads(Mesh(pp=2), rank, timeout=60.0)
    assert time.monotonic() - start < 10


def test_receives_posted_ahead_are_filled_in_the_order_posted_and_counted_once():
    """``post_recv_p2p`` before the matching sends, then one receive posted with
    ``exchange_p2p``: each peer's messages fill them in the order they were posted."""
    def rank(comm):
        me, peer = comm.rank, 1 - comm.rank
        ahead = comm.post_recv_p2p([(peer, (2,), torch.float32), (peer, (1,), torch.float64)])
        (third,) = comm.exchange_p2p([(peer, torch.tensor([1.0, me])), (peer, torch.tensor([2.0], dtype=torch.float64)),
                                      (peer, torch.tensor([3.0 + me]))], [(peer, (1,), torch.float32)])
        return [h.wait() for h in ahead] + [third], comm.counts()

    (got0, counts), (got1, _) = run_threads(Mesh(pp=2), rank)
    assert [t.tolist() for t in got0] == [[1.0, 1.0], [2.0], [4.0]]
    assert [t.tolist() for t in got1] == [[1.0, 0.0], [2.0], [3.0]]
    assert got0[1].dtype == torch.float64
    assert counts["p2p"] == counts["send_bytes"] == counts["recv_bytes"] == 2 * 4 + 8 + 4
