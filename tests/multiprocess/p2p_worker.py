"""Two gloo processes exchanging point to point (``DistComm.exchange_p2p``, receives posted
ahead with ``post_recv_p2p``), as pipeline stages do; ``--die`` makes rank 1 exit before it sends (rank 0 must name it, not hang)."""

import argparse
import os

import torch

from fsdpx.runtime.dist_comm import init_from_env, shutdown
from fsdpx.sharding import Mesh, RankFailure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--die", action="store_true")
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
        ahead = comm.post_recv_p2p([(peer, (2,), torch.float32), (peer, (2,), torch.float32)])
        (third,) = comm.exchange_p2p([(peer, torch.tensor([1.0, me])), (peer, torch.tensor([2.0, me])),
                                      (peer, torch.tensor([3.0, me]))], [(peer, (2,), torch.float32)])
        got += [h.wait() for h in ahead] + [third]
        comm.flush_p2p()  # the sends complete (a pipeline step ends this way)
        result = {"got": got, "counts": comm.counts()}
    except RankFailure as e:
        result = {"failure": e.ranks}
    torch.save(result, f"{args.out}/rank{me}.pt")
    if "failure" not in result:
        shutdown()


if __name__ == "__main__":
    main()
