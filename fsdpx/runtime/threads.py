"""The in-process backend of ``fsdpx.sharding.comm.Comm``: the ranks of a mesh as threads.

At each collective the threads meet at a barrier, one of them runs ``SimulatedMesh.run`` on
the list of all ranks' tensors (sums in rank order: bit-reproducible), and each takes its own
result. Exact and fast: the property tests run every strategy through it. Bytes are counted by
the ``SimulatedMesh`` (the worst group's, per collective kind).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch import Tensor

from fsdpx.sharding.collectives import Collective
from fsdpx.sharding.comm import RankFailure
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.simulated import SimulatedMesh


class _Exchange:
    """Shared by the threads of one simulated mesh: a barrier and the slots it fills."""

    def __init__(self, mesh: Mesh, timeout: float):
        self.sim = SimulatedMesh(mesh)
        self.slots: list[Any] = [None] * mesh.size
        self.results: list[Any] = []
        self.work: Callable[[list[Any]], list[Any]] | None = None
        self.barrier = threading.Barrier(mesh.size, action=self._act, timeout=timeout)
        self.release = threading.Barrier(mesh.size, timeout=timeout)

    def _act(self) -> None:
        self.results = self.work(self.slots) if self.work else list(self.slots)

    def exchange(self, rank: int, value: Any, work: Callable[[list[Any]], list[Any]]) -> Any:
        self.slots[rank] = value
        self.work = work  # every rank sets the same work; the barrier's action runs it once
        try:
            self.barrier.wait()  # the last to arrive runs ``work`` on all slots
            result = self.results[rank]
            self.release.wait()  # nobody overwrites slots before everyone has read
        except threading.BrokenBarrierError:
            raise RankFailure([r for r in range(len(self.slots)) if r != rank], "a peer thread failed") from None
        return result


class ThreadComm:
    """One rank of an in-process simulated mesh (see the module docstring)."""

    def __init__(self, rank: int, exchange: _Exchange):
        self.rank = rank
        self.mesh = exchange.sim.mesh
        self._ex = exchange

    def run(self, collective: Collective, local: Tensor) -> Tensor:
        return self._ex.exchange(self.rank, local, lambda xs: self._ex.sim.run(collective, xs))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._ex.exchange(self.rank, obj, lambda xs: [list(xs)] * len(xs))

    def counts(self) -> dict[str, int]:
        return dict(self._ex.sim.counts)

    def reset_counts(self) -> None:
        if self.rank == 0:
            self._ex.sim.reset_counts()


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
            exchange.barrier.abort()
            exchange.release.abort()

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
