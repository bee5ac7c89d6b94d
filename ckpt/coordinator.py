"""How the ranks of one save agree, with no ``torch.distributed`` in the core.

A save needs two collective steps: ``gather`` every rank's report (file durable, or the error)
to rank 0, and ``broadcast`` rank 0's decision (temporary directory, then commit or abort).
Messages are JSON values, copied through a JSON round trip, so no rank ever sees another's
objects and nothing is pickled. Three implementations:

* ``SingleProcess()``: one rank; both steps are identities.
* ``ThreadGroup(world).member(rank)``: ranks are threads of one process (the simulated mesh).
* ``TorchDistCoordinator()``: ranks are ``torch.distributed`` processes. It makes its own gloo
  group, so a save running in a background thread never interleaves with training collectives
  on the default group; messages travel as uint8 tensors (``all_gather``), not pickles.

Guarantees: ``gather`` returns every rank's message in rank order on rank 0 and ``None``
elsewhere; ``broadcast`` returns rank 0's message on every rank
(``tests/test_ckpt_commit.py::test_thread_group_gathers_in_rank_order``). A rank that never
arrives makes the others fail after ``timeout`` seconds instead of hanging forever.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any

from .errors import SaveError

Json = Any


def _copy(obj: Json) -> Json:
    return json.loads(json.dumps(obj))


class Coordinator(ABC):
    rank: int
    world: int

    @abstractmethod
    def gather(self, obj: Json) -> list[Json] | None:
        """Every rank's ``obj`` on rank 0 (rank order); ``None`` on the others."""

    @abstractmethod
    def broadcast(self, obj: Json) -> Json:
        """Rank 0's ``obj`` on every rank (the others' argument is ignored)."""


class SingleProcess(Coordinator):
    rank, world = 0, 1

    def gather(self, obj: Json) -> list[Json] | None:
        return [_copy(obj)]

    def broadcast(self, obj: Json) -> Json:
        return _copy(obj)


class ThreadGroup:
    """Shared state of ``world`` thread-ranks; hand ``member(r)`` to the thread of rank r."""

    def __init__(self, world: int, *, timeout: float = 300.0) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[Json] = [None] * world

    def member(self, rank: int) -> "ThreadCoordinator":
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for a group of {self.world}")
        return ThreadCoordinator(self, rank)

    def _wait(self, rank: int) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise SaveError(f"rank {rank}: another rank of the save did not arrive (timeout or failure)") from None


class ThreadCoordinator(Coordinator):
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def gather(self, obj: Json) -> list[Json] | None:
        g = self.group
        g._slots[self.rank] = _copy(obj)
        g._wait(self.rank)
        out = list(g._slots) if self.rank == 0 else None
        g._wait(self.rank)  # nobody writes a slot again before rank 0 has read them all
        return out

    def broadcast(self, obj: Json) -> Json:
        g = self.group
        if self.rank == 0:
            g._slots[0] = _copy(obj)
        g._wait(self.rank)
        out = _copy(g._slots[0])
        g._wait(self.rank)
        return out


class TorchDistCoordinator(Coordinator):
    """Collective constructor: every rank must create it (it creates a gloo group)."""

    def __init__(self, *, timeout: float = 1800.0) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        import torch

        dist = self._dist
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=self.group)
        return [bytes(o[: int(s)].numpy()) for o, s in zip(outs, sizes)]

    def gather(self, obj: Json) -> list[Json] | None:
        msgs = self._all_gather_bytes(json.dumps(obj).encode())
        return [json.loads(m) for m in msgs] if self.rank == 0 else None

    def broadcast(self, obj: Json) -> Json:
        msgs = self._all_gather_bytes(json.dumps(obj).encode() if self.rank == 0 else b"null")
        return json.loads(msgs[0])
