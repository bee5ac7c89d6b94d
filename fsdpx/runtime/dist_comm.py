"""``Comm`` over real ``torch.distributed`` (gloo on CPU, NCCL on GPU: the backend is the run's
device's, :func:`backend_for`), launched by torchrun.

Each ``Collective`` of the algebra becomes one call on the process group of its mesh axes:

* ``all_gather``: every rank pads its block to the full chunk (``ceil(n/k)``) along the dim,
  ``all_gather_into_tensor``, then trims each peer's block to its true ``torch.chunk`` size;
* ``reduce_scatter``: pads the dim to ``k * ceil(n/k)`` and ``reduce_scatter_tensor``s;
* ``all_reduce``: ``all_reduce``; ``all_to_all``: ``all_to_all`` of per-peer chunks;
* ``local_slice`` / ``local_pad``: no communication.

Bytes are counted from the buffers handed to torch.distributed (``buffer_bytes`` convention),
so a test can compare them with ``fsdpx.comm_per_step``. A collective on a sub-mesh
(``Mesh.sub(axes)``) runs on this rank's process group of those axes, with this rank's index
in the group as its rank: tensor-parallel activations, whose shapes differ between groups.

Failure: if a collective fails (a peer died: gloo sees the closed connection; a peer hangs:
the process group's timeout), every surviving rank marks itself in the rendezvous store, waits
a short grace period, and raises :class:`RankFailure` naming the ranks that never marked
themselves. Nothing waits forever.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fsdpx.sharding.collectives import Collective
from fsdpx.sharding.comm import RankFailure
from fsdpx.sharding.layout import chunk_bounds, local_shape
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.simulated import SimulatedMesh


def backend_for(device: torch.device | str) -> str:
    """The process group's backend for tensors on ``device``: ``nccl`` for CUDA, ``gloo`` for
    the CPU (also on a machine with a GPU: the tensors, not the machine, decide)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(mesh: Mesh, *, device: torch.device | str = "cpu", timeout_s: float = 60.0) -> "DistComm":
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...)
    and return this rank's communicator, whose collectives take tensors on ``device``: the CPU
    over gloo, or a GPU over NCCL (``cuda`` without an index is ``cuda:LOCAL_RANK``; it becomes
    this process's current device first, as NCCL needs). Raises ``ValueError`` if the mesh size
    differs from the world size."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun's agent keeps one store across the restarts of --max-restarts: without a
        # prefix per attempt a restarted rank reads its dead peers' addresses and never connects
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend_for(device), store=dist.PrefixStore(f"fsdpx/attempt_{attempt}", store),
                                rank=rank, world_size=world, timeout=timeout)
    return DistComm(mesh, grace_s=min(10.0, timeout_s), device=device)


def shutdown() -> None:
    """Leave the default process group in order: a barrier, so no peer is still sending, then
    ``destroy_process_group``. Call it at the end of a torchrun job: a gloo process that exits
    with its group still alive can abort in C++ teardown ("terminate called without an active
    exception", seen with torch 2.13), turning a finished run into a failed one. No-op when no
    group exists."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


class DistComm:
    """One rank's ``Comm`` over the default process group (see the module docstring)."""

    def __init__(self, mesh: Mesh, *, grace_s: float = 10.0, device: torch.device | str = "cpu"):
        world = dist.get_world_size()
        if mesh.size != world:
            raise ValueError(f"mesh {mesh} has {mesh.size} ranks but the world has {world} processes")
        self.mesh, self.rank, self.grace_s = mesh, dist.get_rank(), grace_s
        self.device = torch.device(device)  # where this rank's tensors live: what the backend moves
        self._groups: dict[tuple[str, ...], tuple[Any, list[int]]] = {}
        self._members: dict[tuple[str, ...], tuple[Any, list[int], int]] = {}  # _group, memoised per axes as asked
        self._counts: dict[str, int] = {}
        self._pending_sends: list = []  # (request, tensor) of isends not yet waited for (flush_p2p)
        self._waiter: _Waiter | None = None  # started by the first watched receive
        self._make_groups()

    def _make_groups(self) -> None:
        """Every rank creates every group of every axis set in the same order (torch requires it)."""
        names = self.mesh.axis_names
        subsets = [tuple(n for i, n in enumerate(names) if mask >> i & 1) for mask in range(1, 2 ** len(names))]
        for axes in subsets:
            for members in self.mesh.groups(axes):
                pg = dist.new_group(sorted(members))
                if self.rank in members:
                    self._groups[axes] = (pg, members)

    def _group(self, axes: tuple[str, ...]) -> tuple[Any, list[int], int]:
        """Process group, members in the order of ``axes`` (``Mesh.groups``), this rank's
        position among them; computed once per ``axes`` (every collective asks)."""
        axes = tuple(axes)
        if axes not in self._members:
            key = tuple(n for n in self.mesh.axis_names if n in axes)
            pg, _ = self._groups[key]
            members = next(g for g in self.mesh.groups(axes) if self.rank in g)
            self._members[axes] = (pg, members, members.index(self.rank))
        return self._members[axes]

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def reset_counts(self) -> None:
        self._counts.clear()

    def _count(self, c: Collective, buffer: int) -> None:
        self._counts[c.kind] = self._counts.get(c.kind, 0) + buffer
        self._counts["send_bytes"] = self._counts.get("send_bytes", 0) + c.send_bytes
        self._counts["recv_bytes"] = self._counts.get("recv_bytes", 0) + c.recv_bytes

    def run(self, c: Collective, local: Tensor) -> Tensor:
        if c.kind in ("local_slice", "local_pad"):
            self._count(c, 0)
            return self._local_only(c, local)
        try:
            return getattr(self, "_" + c.kind)(c, local)
        except RuntimeError as e:
            raise self._failure(e) from e

    def run_async(self, c: Collective, local: Tensor) -> "_Pending":
        """``Comm.run_async``: an all-reduce runs on gloo's thread (``async_op``) while the
        caller goes on; other kinds run now."""
        if c.kind != "all_reduce":
            return _Pending(self, None, self.run(c, local))
        pg, members, _ = self._group(c.axes)
        out = local.detach().clone().contiguous()
        self._count(c, out.numel() * out.element_size())
        if len(members) == 1:  # a group of one: the sum is the input
            return _Pending(self, None, out)
        try:
            return _Pending(self, dist.all_reduce(out, group=pg, async_op=True), out)
        except RuntimeError as e:
            raise self._failure(e) from e

    def _local_only(self, c: Collective, local: Tensor) -> Tensor:
        """Run a communication-free step: feed the simulated executor a list where only this
        rank's entry matters (each rank's output depends on its own input alone). A rank whose
        block has another shape (uneven chunks: a vocabulary of 69 rows over ``tp = 2``) gets a
        stand-in of its shape that owns no memory, so the executor's shape checks pass."""
        me = self._rank_in(c)
        stand_in = local.new_zeros(())

        def entry(r: int) -> Tensor:
            shape = local_shape(c.shape, c.src, c.mesh, r)
            return local if r == me or tuple(shape) == tuple(local.shape) else stand_in.expand(shape)

        return SimulatedMesh(c.mesh).run(c, [entry(r) for r in range(c.mesh.size)])[me]

    def _rank_in(self, c: Collective) -> int:
        """This rank's rank on ``c.mesh``: itself on the whole mesh, its index in its group on a
        sub-mesh (``Mesh.sub``: a collective of one group, e.g. over ``tp`` only)."""
        if c.mesh == self.mesh:
            return self.rank
        return self.mesh.index(self.rank, self.mesh.sub_axes(c.mesh))

    def _sizes(self, c: Collective, n: int, k: int) -> list[int]:
        return [b - a for a, b in (chunk_bounds(n, k, j) for j in range(k))]

    def _all_gather(self, c: Collective, local: Tensor) -> Tensor:
        pg, members, _ = self._group(c.axes)
        (d,) = c.dims
        k = len(members)
        full_n = local_shape(c.shape, c.dst, c.mesh, self._rank_in(c))[d]  # the dim's length after the gather
        sizes = self._sizes(c, full_n, k)
        pad = max(sizes)
        block = _pad(local.contiguous(), d, pad)
        flat = torch.empty((k * block.shape[0], *block.shape[1:]) if block.dim() else (k,), dtype=local.dtype,
                           device=local.device)
        self._count(c, flat.numel() * flat.element_size())
        _ALL_GATHER(flat, block, group=pg)  # peers' blocks one after another
        if d == 0 and members == sorted(members) and all(n == pad for n in sizes):
            return flat  # already the concatenation, in order, with nothing to trim: no copy
        out = flat.view(k, *block.shape)
        by_rank = {r: out[i] for i, r in enumerate(sorted(members))}
        pieces = [by_rank[r].narrow(d, 0, sizes[j]) for j, r in enumerate(members)]
        return torch.cat(pieces, d)

    def gather_into(self, collectives: list[Collective], locals_: list[Tensor], outs: list[Tensor]) -> None:
        """Run several dim-0 all-gathers over the same axes as ONE collective (FSDP2's flat
        buffer): each rank's padded blocks are packed back to back, gathered once, and each
        result is copied straight into its ``outs`` tensor (allocated, of the gathered shape).

        Guarantees: ``outs[i]`` equals ``run(collectives[i], locals_[i])`` bit for bit, and the
        bytes counted are the sum of the per-tensor counts (``tests/multiprocess/test_gloo.py``).
        Raises ``ValueError`` unless every collective is an all-gather along dim 0 over the same
        axes."""
        if not collectives:
            return
        axes = collectives[0].axes
        if any(c.kind != "all_gather" or c.dims != (0,) or c.axes != axes for c in collectives):
            raise ValueError("gather_into batches dim-0 all-gathers over one set of axes only")
        pg, members, _ = self._group(axes)
        k = len(members)
        blocks, layouts = [], []
        for c, local in zip(collectives, locals_):
            sizes = self._sizes(c, local_shape(c.shape, c.dst, c.mesh, self._rank_in(c))[0], k)
            block = _pad(local.contiguous(), 0, max(sizes))
            blocks.append(block.reshape(-1))
            layouts.append((sizes, tuple(block.shape)))
        send = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        flat = send.new_empty(k * send.numel())
        for c, b in zip(collectives, blocks):
            self._count(c, k * b.numel() * b.element_size())
        try:
            _ALL_GATHER(flat, send, group=pg)
        except RuntimeError as e:
            raise self._failure(e) from e
        by_rank = flat.view(k, -1)
        slot = {r: i for i, r in enumerate(sorted(members))}
        offset = 0
        for out, (sizes, shape), b in zip(outs, layouts, blocks):
            seg = by_rank[:, offset:offset + b.numel()].view(k, *shape)
            offset += b.numel()
            if members == sorted(members) and all(n == shape[0] for n in sizes):
                out.view(k, *shape).copy_(seg)  # one strided copy
                continue
            row = 0
            for j, r in enumerate(members):
                out.narrow(0, row, sizes[j]).copy_(seg[slot[r]].narrow(0, 0, sizes[j]))
                row += sizes[j]

    def _reduce_scatter(self, c: Collective, local: Tensor) -> Tensor:
        pg, members, me = self._group(c.axes)
        (d,) = c.dims
        k = len(members)
        n = local.shape[d]
        sizes = self._sizes(c, n, k)
        pad = -(-n // k)
        if d == 0 and members == sorted(members) and n == k * pad and local.is_contiguous():
            flat = local  # the chunks already lie in rank order, equal sized: no copy
        else:
            chunks = [_pad(local.narrow(d, sum(sizes[:j]), sizes[j]), d, pad) for j in range(k)]
            pos = {r: j for j, r in enumerate(members)}
            stacked = torch.stack([chunks[pos[r]] for r in sorted(members)]).contiguous()
            flat = stacked.view(-1, *stacked.shape[2:])
        out = local.new_empty((flat.shape[0] // k, *flat.shape[1:]))
        self._count(c, flat.numel() * flat.element_size())
        _REDUCE_SCATTER(out, flat, group=pg)
        return out.narrow(d, 0, sizes[me]).contiguous()

    def _all_reduce(self, c: Collective, local: Tensor) -> Tensor:
        pg, members, _ = self._group(c.axes)
        out = local.detach().clone().contiguous()  # a new tensor, as every communicator returns
        self._count(c, out.numel() * out.element_size())
        if len(members) > 1:  # a group of one: the sum is the input (counted as the algebra counts it)
            dist.all_reduce(out, group=pg)
        return out

    def _all_to_all(self, c: Collective, local: Tensor) -> Tensor:
        pg, members, me = self._group(c.axes)
        split, concat = c.dims
        k = len(members)
        sizes = self._sizes(c, local.shape[split], k)
        sends = [local.narrow(split, sum(sizes[:j]), sizes[j]).contiguous() for j in range(k)]
        pos = {r: j for j, r in enumerate(members)}
        order = sorted(members)
        recv_shapes = self._peer_shapes(local, split, concat, k, me, members, pg)
        recvs = [torch.empty(recv_shapes[r], dtype=local.dtype, device=local.device) for r in order]
        self._count(c, local.numel() * local.element_size())
        dist.all_to_all(recvs, [sends[pos[r]] for r in order], group=pg)
        by_rank = dict(zip(order, recvs))
        return torch.cat([by_rank[r] for r in members], concat)

    def _peer_shapes(self, local, split, concat, k, me, members, pg) -> dict[int, tuple[int, ...]]:
        """Shapes of the blocks peers send me: their block with ``split`` cut to my chunk."""
        shapes = [None] * len(members)
        dist.all_gather_object(shapes, tuple(local.shape), group=pg)
        out = {}
        for i, r in enumerate(sorted(members)):
            s = list(shapes[i])
            a, b = chunk_bounds(s[split], k, me)
            s[split] = b - a
            out[r] = tuple(s)
        return out

    def exchange_p2p(self, sends, recvs) -> list[Tensor]:
        """``fsdpx.sharding.comm.Comm.exchange_p2p`` as one ``batch_isend_irecv`` (receives
        posted with the sends, so two stages exchanging both ways never wait on each other).
        The receives are waited for here, at most the process group's timeout; the sends are
        kept (with their tensors) until ``flush_p2p``, so a send never waits for its receive."""
        ops, out, kept = [], [], []
        for peer, t in sends:
            t = t.detach().to(self.device).contiguous()  # a host header (parts_p2p) travels by the backend's device
            kept.append(t)
            ops.append(dist.P2POp(dist.isend, t, peer))
        for peer, shape, dtype in recvs:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            out.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, peer))
        sent = sum(t.numel() * t.element_size() for _, t in sends)
        self._counts["p2p"] = self._counts.get("p2p", 0) + sent
        self._counts["send_bytes"] = self._counts.get("send_bytes", 0) + sent
        self._counts["recv_bytes"] = self._counts.get("recv_bytes", 0) + sum(b.numel() * b.element_size() for b in out)
        if not ops:
            return out
        try:
            reqs = dist.batch_isend_irecv(ops)
            self._pending_sends += list(zip(reqs[:len(kept)], kept))
            for req in reqs[len(kept):]:
                req.wait()
        except RuntimeError as e:
            raise self._failure(e) from e
        return out

    def post_recv_p2p(self, recvs, *, watch: bool = False) -> list["_PendingRecv"]:
        """``fsdpx.sharding.comm.Comm.post_recv_p2p``: one ``irecv`` each, waited for by the
        handle (at most the process group's timeout). ``watch`` on a CPU (gloo) group: one
        daemon thread per ``DistComm`` waits for the watched receives in posting order and
        marks each handle done (gloo's receive reports arrival only once waited for, and a
        receive must be waited for by one thread only: the handle then waits on that mark)
        (``tests/multiprocess/test_gloo.py::test_a_watched_receive_reports_arrival_before_its_wait``)."""
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for _, shape, dtype in recvs]
        self._counts["recv_bytes"] = self._counts.get("recv_bytes", 0) + sum(b.numel() * b.element_size() for b in bufs)
        try:
            reqs = [dist.irecv(buf, peer) for buf, (peer, _, _) in zip(bufs, recvs)]
        except RuntimeError as e:
            raise self._failure(e) from e
        handles = [_PendingRecv(self, req, buf) for req, buf in zip(reqs, bufs)]
        if watch and self.device.type == "cpu":
            if self._waiter is None:
                self._waiter = _Waiter()
            for h in handles:
                self._waiter.watch(h)
        return handles

    def flush_p2p(self) -> None:
        """Wait for every send still in flight (each at most the process group's timeout)."""
        pending, self._pending_sends = self._pending_sends, []
        try:
            for req, _ in pending:
                req.wait()
        except RuntimeError as e:
            raise self._failure(e) from e

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.mesh.size
        try:
            dist.all_gather_object(out, obj)
        except RuntimeError as e:
            raise self._failure(e) from e
        return out

    def all_gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same count on every rank), index = rank, as Python floats:
        one all-gather of a float64 tensor on this rank's device, nothing pickled (the step's
        metrics, every step). Integers of magnitude below 2**53 come back exact. Not counted in
        ``counts`` (bookkeeping, as ``all_gather_object``)."""
        local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.mesh.size)]
        try:
            dist.all_gather(out, local)
        except RuntimeError as e:
            raise self._failure(e) from e
        return [t.tolist() for t in out]

    def all_gather_stats(self, local: Tensor) -> Tensor:
        """Every rank's ``local`` (a small tensor of the same shape and dtype on every rank, on
        this rank's device) stacked, ``[world, *local.shape]``, on the device: one all-gather,
        nothing read on the host, so a GPU step's metrics do not make the step wait (they are read
        after it, :class:`privacy.step_metrics.StepMetrics`). Not counted in ``counts``."""
        flat = local.detach().reshape(-1).contiguous()
        out = flat.new_empty(self.mesh.size * flat.numel())  # gloo wants the flat concatenation
        try:
            _ALL_GATHER(out, flat)
        except RuntimeError as e:
            raise self._failure(e) from e
        return out.view(self.mesh.size, *local.shape)

    def _failure(self, error: Exception) -> Exception:
        """Mark this rank alive in the store, wait for the other survivors, name the rest."""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"fsdpx/alive/{self.rank}", "1")
            deadline = time.monotonic() + self.grace_s
            missing = list(range(self.mesh.size))
            while time.monotonic() < deadline and missing:
                missing = [r for r in missing if not store.check([f"fsdpx/alive/{r}"])]
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store lives on rank 0's host process
            missing = [0] if self.rank != 0 else []
        if not missing:
            return error  # everyone is alive: not a rank failure, the original error stands
        return RankFailure(missing, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")


# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.5) have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pad(t: Tensor, dim: int, size: int) -> Tensor:
    extra = size - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


class _PendingRecv:
    """A posted ``irecv`` of ``DistComm.post_recv_p2p``; ``arrived`` is set by the ``_Waiter``
    when the receive is watched (``error``: what its wait raised)."""

    def __init__(self, comm: DistComm, req: Any, buf: Tensor):
        self.comm, self.req, self.buf = comm, req, buf
        self.arrived: threading.Event | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the message is known to be in. gloo's receive work reports completion only
        once ``wait`` has run (checked with torch 2.13), so on gloo this is False until then
        unless the receive is watched; NCCL's checks the work's CUDA event."""
        if self.arrived is not None:
            return self.arrived.is_set()
        return self.req.is_completed()

    def wait(self) -> Tensor:
        try:
            if self.arrived is None:
                self.req.wait()
            else:  # the waiter thread waits on the work (bounded by the group's timeout)
                self.arrived.wait()
                if self.error is not None:
                    raise self.error
        except RuntimeError as e:
            raise self.comm._failure(e) from e
        return self.buf


class _Waiter:
    """A daemon thread that waits for watched receives in the order they were posted and marks
    each one's ``arrived`` (its error kept for the handle to raise). Waiting releases the GIL;
    a receive that never comes ends in the group's timeout, as a direct wait would."""

    def __init__(self):
        self._queue: queue.SimpleQueue[_PendingRecv] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="fsdpx-recv-waiter", daemon=True).start()

    def watch(self, handle: _PendingRecv) -> None:
        handle.arrived = threading.Event()
        self._queue.put(handle)

    def _run(self) -> None:
        while True:
            handle = self._queue.get()
            try:
                handle.req.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting handle
                handle.error = e
            handle.arrived.set()


class _Pending:
    """A collective of ``DistComm.run_async`` (``work`` None: already done)."""

    def __init__(self, comm: DistComm, work: Any, out: Tensor):
        self.comm, self.work, self.out = comm, work, out

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> Tensor:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise self.comm._failure(e) from e
            self.work = None
        return self.out
