"""The communicator interface a rank's train step talks to.

A train step is written SPMD style: every rank runs the same function with its own ``Comm``
and its own tensors, and calls ``comm.run(collective, local)`` where the algebra
(``fsdpx.sharding.collectives.plan``) says a layout changes. Backends live in the runtime:

* ``fsdpx.runtime.threads.ThreadComm``: the ranks of a mesh are threads of one process; at
  each collective one thread runs ``SimulatedMesh.run`` on all ranks' tensors (sums in rank
  order: bit-reproducible). Exact and fast: the property tests run every strategy through it.
* ``fsdpx.runtime.dist_comm.DistComm``: real ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Both count the bytes of every collective by kind (``buffer_bytes`` convention of
``fsdpx.sharding.collectives``); a step reports them and tests compare them with
``comm_per_step``. The interface lives at the bottom layer so that ``offload`` and ``privacy``
can talk to a communicator without importing the runtime.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from .collectives import Collective
from .mesh import Mesh


class RankFailure(RuntimeError):
    """Another rank failed or stopped answering; ``ranks`` names it (them)."""

    def __init__(self, ranks: Sequence[int], detail: str):
        self.ranks = list(ranks)
        super().__init__(f"rank(s) {self.ranks} failed or did not answer: {detail}")


class PendingRecv(Protocol):
    def done(self) -> bool:
        """Has it arrived (``wait`` would not block)? Never blocks; may say False until waited for."""

    def wait(self) -> Tensor:
        """The received tensor, once it has arrived (at most the timeout; else ``RankFailure``)."""


class Pending(Protocol):
    def done(self) -> bool:
        """Has it completed (``wait`` would not block)? Never blocks; may say False until waited for."""

    def wait(self) -> Tensor:
        """The collective's result for this rank (at most the timeout; else ``RankFailure``)."""


class Comm(Protocol):
    rank: int
    mesh: Mesh

    def run(self, collective: Collective, local: Tensor) -> Tensor:
        """This rank's result of ``collective`` applied to every rank's ``local``."""

    def run_async(self, collective: Collective, local: Tensor) -> Pending:
        """``run`` started now and finished by the handle's ``wait``: the caller computes
        meanwhile (a private pipeline's per-microbatch norms). Every rank of the group starts
        its collectives in the same order; a backend may run it only when waited for."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, index = rank (start-up checks, metrics)."""

    def exchange_p2p(self, sends: Sequence[tuple[int, Tensor]],
                     recvs: Sequence[tuple[int, tuple[int, ...], torch.dtype]]) -> list[Tensor]:
        """Point to point, all at once (pipeline stages): send each ``(peer, tensor)`` and
        receive one tensor of ``(peer, shape, dtype)`` from each; returns the received tensors
        in the order of ``recvs``. Messages between two ranks arrive in the order sent. Bytes
        count as kind ``p2p`` (what this rank sends) and in ``send_bytes`` / ``recv_bytes``.
        A peer that never sends raises ``RankFailure`` naming it within the timeout. Sends may
        complete after the call returns (never wait for their receive): the tensors must not
        change until ``flush_p2p``."""

    def post_recv_p2p(self, recvs: Sequence[tuple[int, tuple[int, ...], torch.dtype]], *,
                      watch: bool = False) -> list["PendingRecv"]:
        """Post receives of ``(peer, shape, dtype)`` now and return at once, one handle each
        (``wait()`` gives the tensor). A peer's messages fill this rank's receives in the
        order they were posted, here or by ``exchange_p2p``. A pipeline posts its receives
        ahead of need: on a rendezvous transport (gloo) a send whose receive is already
        posted leaves at once from the sender's own thread, instead of waiting for the
        receiver to ask and the sender's transport thread to answer.

        ``done()`` never says True for a message that is not in; without ``watch`` it may say
        False for one that is (gloo's receive reports arrival only once waited for). With
        ``watch`` a transport that cannot tell otherwise has a thread wait for the receives
        (in posting order) so ``done()`` turns True soon after each arrives, at the price of
        a thread handoff per receive: for a caller with other work to fill the wait."""

    def flush_p2p(self) -> None:
        """Wait until every send of ``exchange_p2p`` so far has completed (end of a step)."""

    def counts(self) -> dict[str, int]:
        """Bytes per collective kind moved by ``run`` since the last ``reset_counts``."""

    def reset_counts(self) -> None: ...
