"""The in-process backend of ``fsdpx.sharding.comm.Comm``: the ranks of a mesh as threads.

At each collective the threads meet at a barrier, one of them runs ``SimulatedMesh.run`` on
the list of all ranks' tensors (sums in rank order: bit-reproducible), and each takes its own
result. Exact and fast: the property tests run every strategy through it. Bytes are counted by
the ``SimulatedMesh`` (the worst group's, per collective kind).
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable

import torch
from torch import Tensor

from fsdpx.sharding.collectives import Collective
from fsdpx.sharding.comm import RankFailure
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.simulated import SimulatedMesh


class _Rendezvous:
    """A barrier of ``size`` threads and the slots it fills: the last to arrive runs ``work``
    on everyone's value, then each takes its own result."""

    def __init__(self, members: list[int], timeout: float):
        self.members = members
        self.slots: list[Any] = [None] * len(members)
        self.results: list[Any] = []
        self.work: Callable[[list[Any]], list[Any]] | None = None
        self.barrier = threading.Barrier(len(members), action=self._act, timeout=timeout)
        self.release = threading.Barrier(len(members), timeout=timeout)

    def _act(self) -> None:
        self.results = self.work(self.slots) if self.work else list(self.slots)

    def exchange(self, index: int, value: Any, work: Callable[[list[Any]], list[Any]]) -> Any:
        self.slots[index] = value
        self.work = work  # every member sets the same work; the barrier's action runs it once
        try:
            self.barrier.wait()  # the last to arrive runs ``work`` on all slots
            result = self.results[index]
            self.release.wait()  # nobody overwrites slots before everyone has read
        except threading.BrokenBarrierError:
            me = self.members[index]
            raise RankFailure([r for r in self.members if r != me], "a peer thread failed") from None
        return result

    def abort(self) -> None:
        self.barrier.abort()
        self.release.abort()


class _Exchange:
    """Shared by the threads of one simulated mesh: the whole mesh's rendezvous and, created on
    first use, one per group of a sub-mesh (a collective over some axes, run by that group only,
    as a process group of those axes runs it)."""

    def __init__(self, mesh: Mesh, timeout: float):
        self.sim = SimulatedMesh(mesh)
        self.timeout = timeout
        self.full = _Rendezvous(list(range(mesh.size)), timeout)
        self.groups: dict[tuple[int, ...], _Rendezvous] = {}
        self.mailboxes: dict[tuple[int, int], queue.Queue] = {}  # (src, dst) -> messages in order
        self.lock = threading.Lock()
        self.aborted = False

    def mailbox(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            box = self.mailboxes.setdefault((src, dst), queue.Queue())
            if self.aborted:
                box.put(_ABORTED)
            return box

    def group(self, members: list[int]) -> _Rendezvous:
        with self.lock:
            key = tuple(members)
            if key not in self.groups:
                self.groups[key] = _Rendezvous(list(members), self.timeout)
                if self.aborted:
                    self.groups[key].abort()
            return self.groups[key]

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            for r in [self.full, *self.groups.values()]:
                r.abort()
            for box in self.mailboxes.values():
                box.put(_ABORTED)  # wakes a receiver waiting on a peer that failed


_ABORTED = object()


class ThreadComm:
    """One rank of an in-process simulated mesh (see the module docstring).

    A collective on ``mesh`` itself is a rendezvous of every rank (each group's result computed
    by ``SimulatedMesh.run``, bytes counted for the worst group). A collective on a SUB-mesh
    (``mesh.sub(axes)``: tensor-parallel activations, whose shapes differ between data-parallel
    groups) is a rendezvous of this rank's group only, and its bytes are counted when the group
    holds rank 0, the rank ``comm_per_step`` describes."""

    def __init__(self, rank: int, exchange: _Exchange):
        self.rank = rank
        self.mesh = exchange.sim.mesh
        self._ex = exchange
        # per peer: receives posted so far, messages taken from its mailbox so far, and the
        # taken ones whose receive has not been waited for yet (by posting number)
        self._posted: dict[int, int] = {}
        self._taken: dict[int, int] = {}
        self._early: dict[int, dict[int, Any]] = {}

    def run(self, collective: Collective, local: Tensor) -> Tensor:
        if collective.mesh == self.mesh:
            return self._ex.full.exchange(self.rank, local, lambda xs: self._ex.sim.run(collective, xs))
        axes = self.mesh.sub_axes(collective.mesh)
        members = next(g for g in self.mesh.groups(axes) if self.rank in g)
        counted = 0 in members

        def work(xs: list[Tensor]) -> list[Tensor]:
            sim = SimulatedMesh(collective.mesh)
            out = sim.run(collective, xs)
            if counted:
                self._ex.sim.add_counts(sim.counts)
            return out

        return self._ex.group(members).exchange(members.index(self.rank), local, work)

    def run_async(self, collective: Collective, local: Tensor) -> "_Deferred":
        """``Comm.run_async``: the rendezvous happens when waited for (``done`` is False
        until then), so ranks meet in the order they wait, which is the order they started."""
        return _Deferred(lambda: self.run(collective, local))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._ex.full.exchange(self.rank, obj, lambda xs: [list(xs)] * len(xs))

    def all_gather_stats(self, local: Tensor) -> Tensor:
        """``DistComm.all_gather_stats``: every rank's ``local`` stacked, ``[world, *local.shape]``;
        nothing is read on the host. Not counted (bookkeeping)."""
        return self._ex.full.exchange(self.rank, local.detach().clone(), lambda xs: [torch.stack(xs)] * len(xs))

    def exchange_p2p(self, sends, recvs) -> list[Tensor]:
        """``fsdpx.sharding.comm.Comm.exchange_p2p``: each send is a copy put in the
        ``(self, peer)`` mailbox (sends never wait); each receive waits for its mailbox, at
        most the timeout. Bytes are counted for rank 0, as for group collectives."""
        sent = 0
        for peer, t in sends:
            self._ex.mailbox(self.rank, peer).put(t.detach().clone())
            sent += t.numel() * t.element_size()
        if self.rank == 0:
            self._ex.sim.add_counts({"p2p": sent, "send_bytes": sent})
        return [r.wait() for r in self.post_recv_p2p(recvs)]

    def post_recv_p2p(self, recvs, *, watch: bool = False) -> list["_MailboxRecv"]:
        """``fsdpx.sharding.comm.Comm.post_recv_p2p``: each receive gets the next number
        from its peer and, when waited for, the message of that number (mailboxes keep every
        send, so messages taken for later receives wait here). Bytes count when posted.
        ``watch`` changes nothing: ``done()`` stays False until the wait (conservative)."""
        if self.rank == 0:
            self._ex.sim.add_counts({"recv_bytes": sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in recvs)})
        handles = []
        for peer, shape, dtype in recvs:
            number = self._posted.get(peer, 0)
            self._posted[peer] = number + 1
            handles.append(_MailboxRecv(self, peer, number, tuple(shape), dtype))
        return handles

    def _take(self, peer: int, number: int, shape: tuple[int, ...], dtype) -> Tensor:
        """Message ``number`` from ``peer`` (0 = the first it sent)."""
        early = self._early.setdefault(peer, {})
        while number not in early:
            try:
                got = self._ex.mailbox(peer, self.rank).get(timeout=self._ex.timeout)
            except queue.Empty:
                raise RankFailure([peer], f"no message from rank {peer} within {self._ex.timeout:g} s") from None
            if got is _ABORTED:
                raise RankFailure([peer], "a peer thread failed")
            early[self._taken.get(peer, 0)] = got
            self._taken[peer] = self._taken.get(peer, 0) + 1
        msg = early.pop(number)
        if tuple(msg.shape) != shape or msg.dtype != dtype:
            raise ValueError(f"rank {self.rank} expected {shape} {dtype} from rank {peer}, got"
                             f" {tuple(msg.shape)} {msg.dtype}")
        return msg

    def flush_p2p(self) -> None:
        """Sends are copies put in mailboxes: complete when made."""

    def counts(self) -> dict[str, int]:
        return dict(self._ex.sim.counts)

    def reset_counts(self) -> None:
        if self.rank == 0:
            self._ex.sim.reset_counts()


class _Deferred:
    """A collective of ``ThreadComm.run_async``: run by the first ``wait``."""

    def __init__(self, run: Callable[[], Tensor]):
        self._run, self._out = run, None

    def done(self) -> bool:
        return self._out is not None

    def wait(self) -> Tensor:
        if self._out is None:
            self._out = self._run()
        return self._out


class _MailboxRecv:
    """A receive posted on the simulated mesh: taken from the mailbox when waited for."""

    def __init__(self, comm: ThreadComm, peer: int, number: int, shape: tuple[int, ...], dtype):
        self.comm, self.peer, self.number, self.shape, self.dtype = comm, peer, number, shape, dtype

    def done(self) -> bool:
        return False  # known only by taking it: wait

    def wait(self) -> Tensor:
        return self.comm._take(self.peer, self.number, self.shape, self.dtype)


def run_threads(mesh: Mesh, fn: Callable[[ThreadComm], Any], *, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(comm)`` once per rank of ``mesh``, each in its own thread; returns the results
    by rank. If any rank raises, the others are released (never left waiting) and the first
    error is re-raised here."""
    exchange = _Exchange(mesh, timeout)
    results: list[Any] = [None] * mesh.size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(rank, exchange))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append((rank, e))
            exchange.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        primary = [e for e in errors if not isinstance(e[1], RankFailure)] or errors
        rank, err = primary[0]
        raise err
    return results
