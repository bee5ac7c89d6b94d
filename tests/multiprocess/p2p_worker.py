"""Two gloo processes exchanging point to point (``DistComm.exchange_p2p``, receives posted
ahead with ``post_recv_p2p``), as pipeline stages do; ``--die`` makes rank 1 exit before it sends (rank 0 must name it, not hang);
``--watch`` posts the receives ahead watched and records whether each said ``done()`` before its
``wait`` (polled for up to 10 s)."""

import argparse
import os
import time

import torch

from fsdpx.runtime.dist_comm import init_from_env, shutdown
from fsdpx.sharding import Mesh, RankFailure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--die", action="store_true")
    ap.add_argument("--watch", action="store_true")
    ap.add_argument("--die-late", action="store_true", help="rank 1 exits after the first exchange; rank 0 "
                    "then waits on a watched receive")
    args = ap.parse_args()
    comm = init_from_env(Mesh(pp=2), timeout_s=20)
    me, peer = comm.rank, 1 - comm.rank
    if args.die and me == 1:
        os._exit(3)
    result = {}
    try:
        got = comm.exchange_p2p([(peer, torch.full((3, 2), float(me))), (peer, torch.arange(5.0) * (me + 1))],
                                [(peer, (3, 2), torch.float32), (peer, (5,), torch.float32)])
        # receives posted ahead of the sends they match (as a pipeline posts them), then
        # one posted with the sends: filled in the order posted
        if args.die_late:
            if me == 1:
                os._exit(3)
            comm.post_recv_p2p([(peer, (2,), torch.float32)], watch=True)[0].wait()
        ahead = comm.post_recv_p2p([(peer, (2,), torch.float32), (peer, (2,), torch.float32)], watch=args.watch)
        (third,) = comm.exchange_p2p([(peer, torch.tensor([1.0, me])), (peer, torch.tensor([2.0, me])),
                                      (peer, torch.tensor([3.0, me]))], [(peer, (2,), torch.float32)])
        deadline = time.monotonic() + 10
        while args.watch and not all(h.done() for h in ahead) and time.monotonic() < deadline:
            time.sleep(0.01)
        done_before_wait = [h.done() for h in ahead]
        got += [h.wait() for h in ahead] + [third]
        comm.flush_p2p()  # the sends complete (a pipeline step ends this way)
        result = {"got": got, "counts": comm.counts(), "done_before_wait": done_before_wait}
    except RankFailure as e:
        result = {"failure": e.ranks}
    torch.save(result, f"{args.out}/rank{me}.pt")
    if "failure" not in result:
        shutdown()


if __name__ == "__main__":
    main()
