"""The pipeline-parallel train step: a schedule (``fsdpx.sharding.schedule``) executed on one
rank, composed with data and tensor parallelism.

Each rank holds the stages of its pipeline index (``PipelineLayout.stages_on``) and only their
parameters (``rank_plan``), each in the plan's data/tensor-parallel layout. One step:

1. this rank's share of the global batch (split over the data axes, as without a pipeline) is
   cut into the layout's microbatches (``microbatch_bounds``: sizes differ by at most one);
2. the rank's actions run in schedule order: ``F`` runs the stage's forward through the model
   (``fsdpx.runtime.stages``) with per-unit gathers (``Gatherer``, one per microbatch and stage)
   and tensor-parallel hooks; the last stage applies the loss. ``B`` back-propagates from the
   stage's output (the loss on the last stage, the received gradient elsewhere); fused schedules
   get the input and weight gradients in one pass, split ones (``zero_bubble``) the input
   gradient in ``B`` and the weight gradients in ``W``. Transfers are ``Comm.exchange_p2p``;
   sends never wait (``Comm.flush_p2p`` at the end of the step), which is what the simulator
   assumes and why no schedule that simulates can deadlock here;
3. a parameter held by two stages on different ranks (a tied embedding and LM head) has its
   gradient summed between them, in stage order on both, so both copies stay bit-identical;
4. reduction over the data axes, noise (private), and the optimizer: exactly the non-pipelined
   step's ``fsdpx.runtime.reduce.reduce_and_update`` on the rank's parameters.

A microbatch that is empty on this data-parallel rank (a batch smaller than ``dp`` times the
microbatch count) still runs its parameter collectives, in the order a real one would, so the
rank's data-parallel peers never wait; it moves no activations (both ends know it is empty).

Guarantee: N pipelined steps equal N unsharded steps, every schedule, with data and tensor
parallelism, float64 to rel 1e-10 (``property_tests/test_pipeline_properties.py``); the bytes
counted equal ``fsdpx.runtime.pipeline.pipeline_p2p_bytes`` plus the plan's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from fsdpx.optim import Optimizer
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import local_shape
from fsdpx.sharding.pipeline import PipelineLayout, microbatch_bounds, pipeline_index, rank_plan
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.schedule import B, F, P2P, RECV_B, RECV_F, SEND_B, SEND_F, SPLIT_BACKWARD, W, Schedule, schedule
from fsdpx.sharding.collectives import cached_plan as plan_collectives
from fsdpx.sharding.spec import Spec
from privacy import contributions as C
from privacy.clipping import deferred_clip_factors, summed_sq_norms
from privacy.errors import NonFiniteGradientError
from privacy.ghost import contributions
from privacy.step import DPConfig, check_budget
from privacy.batch import call_model, first_tensor, slice_batch, unpack
from privacy.tape import LossFn, Tape, fill_grads, taping

from .gather import Gatherer
from .global_batch import NO_STATS, counts_its_share, device_stats, global_metrics, masked_losses, my_share
from .host_heap import raise_thresholds
from .stages import StageExit, StageForward, absent_uses
from .stage_links import zero_parameters
from .parts_p2p import recv_parts, send_parts
from .owned_noise import OwnedNoise
from .reduce import gradient_divisor, reduce_and_update, tensor_bytes, trainable_update
from .replicas import ReplicaCheck
from .sharded_clipping import needs_fallback, sharded_norms
from .sharded_state import ShardedState
from .tensor_parallel import TensorParallelHooks
from .weight_pass import capturing, input_grads, separable, weight_grads
from .units import Unit, make_units


# receives are posted this many transfer groups ahead of the one that waits for them: that
# many more activation-sized buffers held, against a send that finds no receive posted
# (gloo then sends only a notice, and the data waits for the receiver's request, i.e. for the
# sender's I/O thread to get a core back from its compute). An interleaved rank has about
# 2v - 1 times as many transfer groups per microbatch (v chunks each way), so it looks that much
# further ahead (PipelineStep.recv_ahead): at v = 2, 2 processes, 2 groups left the upper
# quartile of in-schedule transit at 0.95-2.1 ms, 6 at 0.46-0.48 (benchmarks/pipeline.py)
RECV_AHEAD = 2


class StageGroupComm:
    """``comm`` seen from the ranks of one pipeline index: ``mesh`` is the full mesh without the
    pipeline axis and ``rank`` this rank's place in it. Parameter and tensor-parallel
    collectives planned on it run within the rank's own stage group (both communicators run a
    collective of a sub-mesh on the caller's group), so stages never wait on each other's
    parameter traffic; everything else is the underlying communicator's."""

    def __init__(self, comm: Comm, axis: str):
        self.base = comm
        self.mesh = comm.mesh.sub(tuple(a for a in comm.mesh.axis_names if a != axis))
        coords = comm.mesh.coords(comm.rank)
        self.rank = self.mesh.rank_of({a: coords[a] for a in self.mesh.axis_names})
        if hasattr(comm, "gather_into"):
            self.gather_into = comm.gather_into

    def run(self, collective, local: Tensor) -> Tensor:
        return self.base.run(collective, local)

    def counts(self) -> dict[str, int]:
        return self.base.counts()


@dataclasses.dataclass
class _Stage:
    """What one stage of this rank needs every step (built once)."""

    index: int
    names: list[str]  # parameters this stage holds, plan order
    plan: ShardingPlan  # restricted to them
    units: list[Unit]
    forward: StageForward


@dataclasses.dataclass
class _InFlight:
    """One microbatch between its F and its last backward action at one stage."""

    gatherer: Gatherer
    inject: Tensor | None  # the stage's input leaf (None at stage 0)
    root: Tensor | None  # what B starts from: the output, or the loss sum at the last stage
    size: int
    grad_out: Tensor | None = None  # the output's gradient, kept from B for a split W
    calls: list | None = None  # private: the tape of the stage's layer calls
    parts: dict | None = None  # private: per-example contributions, kept until the norms are complete
    sq: Tensor | None = None  # private: this stage's share of each example's squared norm
    captured: list | None = None  # split backward: the parameter-owning modules' outputs (weight_pass)


class PipelineStep:
    """One rank's pipelined ``step(state, batch)`` (built by ``make_sharded_step``)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, plan: ShardingPlan, comm: Comm, *,
                 config: DPConfig | None, num_examples: int | None, donate: bool, trainable=None):
        self.model, self.loss_fn, self.optimizer, self.comm = model, loss_fn, optimizer, comm
        # a freezing schedule bound to the plan's names (fsdpx.optim.TrainableSets), or None
        self.trainable, self.now, self._views = trainable, None, {}
        self.plan, self.config, self.num_examples, self.donate = plan, config, num_examples, donate
        layout: PipelineLayout = plan.pipeline
        self.layout = layout
        mesh = comm.mesh
        self.p = layout.degree()
        self.index = pipeline_index(mesh, comm.rank, layout)
        self.schedule: Schedule = schedule(layout.schedule, self.p, layout.microbatches,
                                           virtual_stages=layout.virtual_stages)
        self.split = layout.schedule in SPLIT_BACKWARD
        self.recv_ahead = RECV_AHEAD * (2 * layout.virtual_stages - 1)
        self.local_plan = rank_plan(plan, mesh, comm.rank)
        self.group = StageGroupComm(comm, layout.axis)
        self.replicas = ReplicaCheck(plan, comm, model)  # over the whole mesh: its tp groups are per stage
        self.tensor_parallel = TensorParallelHooks(model, plan, self.group)
        self.stages = self.all_stages = {s: self._stage(s) for s in layout.stages_on(self.index)}
        self.peer = {j: mesh.rank_of({**mesh.coords(comm.rank), layout.axis: j}) for j in range(self.p)}
        self.keep = self.split or (config is not None and needs_fallback(model, self.local_plan.params))
        if config is not None:
            self.tp_norms = tp_norms = sharded_norms(plan, self.group)
            self.counted = tp_norms.counted if tp_norms is not None else frozenset(plan.params)
            # replicated on split features (ReplicatedOnSplit): each example's gradient is summed
            # over tp before its norm, per stage and microbatch
            self.partial = tp_norms.partial if tp_norms is not None else frozenset()
            # a parameter several stages hold: its norm is completed on the rank of the last of them
            self.shared = {n: sorted({st % self.p for st in held}) for n, held in layout.param_stages.items()
                           if len(held) > 1 and n in self.local_plan.params}
        # Private, no parameter in two stages (decided on the layout, so every rank agrees): each
        # microbatch's norms are all-reduced as soon as this rank's backwards of it are done, and
        # its clipped sums (its W) formed once they are complete, inside the schedule. A
        # parameter two stages share needs their contributions summed first: then all at the end.
        self.early_norms = config is not None and all(len(h) == 1 for h in layout.param_stages.values())
        self._shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
        self._gatherers: dict[int, Gatherer] = {}
        self.local_shapes = {n: local_shape(lay.shape, lay.compute, self.group.mesh, self.group.rank)
                             for n, lay in self.local_plan.params.items()}
        # each microbatch frees its temporaries and the next allocates the same sizes: keep them
        # on mapped pages (glibc's own threshold adjustment, once; a no-op elsewhere)
        raise_thresholds()

    def _stage(self, s: int) -> _Stage:
        names = self.layout.params_of([s])
        plan = dataclasses.replace(self.plan, params={n: self.plan.params[n] for n in names})
        block_list = self.layout.blocks
        keys = list(dict(self.model.named_modules())[block_list]._modules)
        modules = [f"{block_list}.{keys[i]}" if block_list else keys[i] for i in self.layout.stages[s]]
        units = [u for u in make_units(self.model, names, modules) if u.params or not u.module]
        absent = absent_uses(self.model, self.plan.params, self.layout, s)
        return _Stage(s, names, plan, units, StageForward(self.model, self.layout, absent))

    def gatherer(self, s: int, at_rest: dict[str, Tensor], trainable: list[str], leaves: dict) -> Gatherer:
        """A Gatherer of stage ``s`` for one microbatch's forward and backward: ``renewed``
        from the stage's first, so the plan is read once per run, not per microbatch; ``leaves``
        (one dict per stage and step) gives a parameter that needs no collective one leaf for
        every microbatch of the step. ``keep``: a split backward walks the graph twice, and a
        private layer without a ghost rule reads its parameters after the backward, so gathered
        parameters stay until then."""
        if s not in self._gatherers:
            st = self.all_stages[s]
            self._gatherers[s] = Gatherer(self.model, st.units, st.plan, self.group, at_rest,
                                          keep_after_backward=self.keep)
        return self._gatherers[s].renewed(at_rest, trainable=trainable, leaves=leaves)

    def _train_now(self, step: int) -> None:
        """Under a freezing schedule, this step's stages: each one's ``names`` (what gets a tape,
        a gradient and an update) cut to the parameters that train now; every parameter of a
        stage is still gathered for its forward and backward."""
        if self.trainable is None:
            return
        self.now = self.trainable(step)
        if self.now not in self._views:
            self._views[self.now] = {s: dataclasses.replace(st, names=[n for n in st.names if n in self.now])
                                     for s, st in self.all_stages.items()}
        self.stages = self._views[self.now]

    # ---- one step ----------------------------------------------------------------------------

    def __call__(self, state, batch):
        if self.config is not None:
            check_budget(state.accountant, self.config)
        self._train_now(state.step)
        before = self.comm.counts()
        share = my_share(batch, self.plan, self.comm)
        mbs = [slice_batch(share, a, b) for a, b in microbatch_bounds(share[1].shape[0], self.layout.microbatches)]
        run = _Run(self, state, mbs)
        run.execute(self.schedule.ranks[self.index])
        if self.config is not None:
            run.clip()
        raw = run.raw_grads()
        self._sum_shared(raw)
        units = [Unit("", tuple(self.local_plan.params), ())]
        update = trainable_update(self.optimizer, self.donate, self.trainable)
        noise = OwnedNoise(state, self.local_plan, self.group, self.config, self.now) if self.config else None
        new_params, opt_state, resident = reduce_and_update(raw, state, self.local_plan, self.group, units, update,
                                                            gradient_divisor(batch, self.config, self.num_examples),
                                                            noise, self.now, self.replicas)
        metrics = global_metrics(self.comm, run.stats(), self.config)
        metrics["comm_bytes"] = {k: v - before.get(k, 0) for k, v in self.comm.counts().items()}
        accountant = state.accountant.record(self.config.noise_multiplier, self.config.sample_rate) \
            if self.config else (None if state.accountant is None else state.accountant.record(0.0, 1.0))
        history = noise.history() if noise is not None else state.noise_history
        metrics["resident_bytes"] = resident + tensor_bytes(history)  # a banded mechanism's past outputs too
        return ShardedState(new_params, opt_state, state.step + 1, state.key, accountant, history), metrics

    def all_reduce_norms(self, sq: Tensor) -> Tensor:
        """Each example's squared norm summed over the ranks sharing its examples: the pipeline
        ranks and, with tensor parallelism, the tensor-parallel ones (ONE all-reduce of the
        rank's batch share)."""
        mesh = self.comm.mesh
        axes = tuple(a for a in mesh.axis_names if a in (self.layout.axis, self.plan.tp_axis) and mesh.axis_size(a) > 1)
        if not axes:
            return sq
        src = Spec.replicated(1)
        (c,) = plan_collectives(src.with_partial(axes), src, tuple(sq.shape), mesh.sub(axes), sq.dtype)
        return self.comm.run(c, sq.contiguous())

    def start_norms(self, sq: Tensor):
        """``all_reduce_norms`` started now (``Comm.run_async``), finished by ``wait()``."""
        mesh = self.comm.mesh
        axes = tuple(a for a in mesh.axis_names if a in (self.layout.axis, self.plan.tp_axis) and mesh.axis_size(a) > 1)
        if not axes:
            return _Ready(sq)
        src = Spec.replicated(1)
        (c,) = plan_collectives(src.with_partial(axes), src, tuple(sq.shape), mesh.sub(axes), sq.dtype)
        return self.comm.run_async(c, sq.contiguous())

    def _sum_shared(self, raw: dict[str, Tensor]) -> None:
        """Gradients of parameters held on several pipeline ranks, summed over them in stage order."""
        for name in self.local_plan.params:
            holders = sorted({s % self.p for s in self.layout.param_stages[name]})
            if len(holders) < 2 or (self.now is not None and name not in self.now):
                continue
            others = [j for j in holders if j != self.index]
            got = self.comm.exchange_p2p([(self.peer[j], raw[name]) for j in others],
                                         [(self.peer[j], tuple(raw[name].shape), raw[name].dtype) for j in others])
            parts = dict(zip(others, got))
            parts[self.index] = raw[name]
            total = parts[holders[0]].clone()
            for j in holders[1:]:
                total += parts[j]
            raw[name] = total

    def boundary(self, inputs) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the hidden state between blocks for microbatch ``inputs`` (as the
        batch holds them: a tensor, a tuple, a mapping of keyword arguments), by
        ``_trace_boundary``, cached by the inputs' structure and shapes."""
        leaves, spec = tree_flatten(inputs)
        key = (str(spec), tuple((tuple(a.shape), a.dtype) if isinstance(a, Tensor) else repr(a) for a in leaves))
        if key not in self._shapes:
            self._shapes[key] = _trace_boundary(self.model, self.layout, inputs)
        return self._shapes[key]


def _trace_boundary(model: nn.Module, layout: PipelineLayout, inputs) -> tuple[tuple[int, ...], torch.dtype]:
    """The hidden state entering the first block, from the model's own forward on the real
    inputs (masks and positions may depend on their values) with every parameter swapped for
    zeros that own one element (nothing real is read), stopped at that block. Blocks keep the
    hidden state's shape (a residual stream), so this is every boundary's."""
    first = next(iter(dict(model.named_modules())[layout.blocks]))
    # the zeros on the inputs' device: the parameters may be on meta (a rank that read only its stages)
    device = next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)), torch.device("cpu"))

    def stop(module, a, kwargs):
        raise StageExit(a[0] if a else kwargs["hidden_states"])

    handle = first.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with zero_parameters(model, device), torch.no_grad():
            call_model(model, inputs)
    except StageExit as e:
        return tuple(e.output.shape), e.output.dtype
    finally:
        handle.remove()
    raise RuntimeError(f"the model's forward never called its first block ({layout.blocks}.0)")


class _Run:
    """The state of one step on one rank: microbatches in flight, messages, gradient sums."""

    def __init__(self, owner: PipelineStep, state, mbs: list[tuple]):
        self.o, self.state, self.mbs = owner, state, mbs
        self.flight: dict[tuple[int, int], _InFlight] = {}
        self.inbox: dict[tuple[str, int, int], Tensor] = {}
        self.outbox: dict[tuple[str, int, int], Tensor] = {}
        self.raw: dict[str, Tensor] = {}
        self.owned: set[str] = set()  # sums this step allocated (safe to add into in place)
        # per stage: the step's leaves of parameters that need no collective (Gatherer.renewed);
        # their .grad is empty between backwards (_backward_into_sums takes it)
        self.leaves: dict[int, dict] = {}
        self.sum_views: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (its running sum, the leaf-shaped view)
        # the last stage's loss sum (float64: the sum of each microbatch's float32 sum, as Python
        # floats would add them) and real examples, kept on the device until the metrics are read
        self.loss_sum: Tensor | None = None
        self.count: Tensor | int = 0

    # ---- the action loop ---------------------------------------------------------------------

    def execute(self, actions) -> None:
        """Run this rank's actions in order; each run of consecutive transfers is one
        ``_transfer`` before the compute action that follows it."""
        items: list = []  # compute actions and transfer groups (lists of P2P), in order
        for a in actions:
            if not isinstance(a, P2P):
                items.append(a)
            elif items and isinstance(items[-1], list):
                items[-1].append(a)
            else:
                items.append([a])
        groups = [item for item in items if isinstance(item, list)]
        # every receive of the step, in schedule order, with the index of its group
        self.recv_order = [(g, a) for g, group in enumerate(groups) for a in group
                           if isinstance(a, (RECV_F, RECV_B)) and self.mbs[a.mb][1].shape[0]]
        self.posted = 0  # receives of recv_order posted so far
        self.pending: dict[tuple[str, int, int], object] = {}
        early = self.o.early_norms
        if early:  # per microbatch: this rank's backwards still to run, then its norms' all-reduce
            self.backwards_left = {mb: len(self.o.stages) for mb in range(len(self.mbs))}
            self.norms_started: dict[int, object] = {}
            self.next_clip = 0  # microbatches clipped so far (in order: the sums' bits never depend on timing)
            self.mb_norms: dict[int, Tensor] = {}
        g = 0
        for item in items:
            if isinstance(item, list):
                self._transfer(item, g)
                g += 1
                continue
            if isinstance(item, F):
                self._forward(item.mb, item.stage)
            elif isinstance(item, B):
                self._backward(item.mb, item.stage, weights=not self.o.split)
                if early:
                    self.backwards_left[item.mb] -= 1
                    if not self.backwards_left[item.mb]:
                        self._start_norms(item.mb)
            elif isinstance(item, W):
                self._weights(item.mb, item.stage)
        self.o.comm.flush_p2p()

    def _hidden(self, mb: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self.o.boundary(self.mbs[mb][0])

    def _post_receives(self, last_group: int) -> None:
        """Post, in schedule order, every receive of the transfer groups up to ``last_group``
        not posted yet."""
        todo = []
        while self.posted < len(self.recv_order) and self.recv_order[self.posted][0] <= last_group:
            todo.append(self.recv_order[self.posted][1])
            self.posted += 1
        if not todo:
            return
        wanted = [(self.o.peer[a.peer], *self._hidden(a.mb)) for a in todo]
        # a private pipeline fills its waits with W's: its receives say when they are in
        for a, handle in zip(todo, self.o.comm.post_recv_p2p(wanted, watch=self.o.early_norms)):
            self.pending[("F" if isinstance(a, RECV_F) else "B", a.mb, a.stage)] = handle

    def _transfer(self, actions: list[P2P], group: int) -> None:
        """Transfer group ``group``: its receives and those of the next ``recv_ahead`` groups
        are posted (before this group's sends: a peer that answers one of these sends finds
        them posted), then its sends leave (never waited for until ``flush_p2p``), then its
        receives are waited for. Receives are posted in schedule order, so each matches its
        send; posting never blocks, so a schedule that simulates still cannot deadlock."""
        self._post_receives(group + self.o.recv_ahead)
        sends, keys = [], []
        for a in actions:
            if self.mbs[a.mb][1].shape[0] == 0:
                continue  # an empty microbatch: both ends know, nothing moves
            peer = self.o.peer[a.peer]
            if isinstance(a, SEND_F):
                sends.append((peer, self.outbox.pop(("F", a.mb, a.stage))))
            elif isinstance(a, SEND_B):
                sends.append((peer, self.outbox.pop(("B", a.mb, a.stage))))
            else:
                keys.append(("F" if isinstance(a, RECV_F) else "B", a.mb, a.stage))
        if sends:
            self.o.comm.exchange_p2p(sends, [])
        for key in keys:
            handle = self.pending.pop(key)
            # a private pipeline's W fills the wait (the bubble): clipped sums whose norms are
            # complete, one at a time until the message is in (watched receives: gloo's report
            # arrival through a waiter thread; the thread mesh's cannot before the wait, so there
            # every ready W runs first)
            while self.o.early_norms and not handle.done() and self._clip_ready(block=False, one=True):
                pass
            self.inbox[key] = handle.wait()

    def _incoming(self, kind: str, mb: int, stage: int, local_from: int) -> Tensor:
        """The activation (``kind`` "F") or gradient ("B") for ``(mb, stage)``: received, or
        handed over directly when stage ``local_from`` runs on this rank too."""
        if (kind, mb, stage) in self.inbox:
            return self.inbox.pop((kind, mb, stage))
        return self.outbox.pop((kind, mb, local_from))

    # ---- compute -----------------------------------------------------------------------------

    def _forward(self, mb: int, s: int) -> None:
        o, st = self.o, self.o.stages[s]
        inputs, targets, mask = unpack(self.mbs[mb])
        last = s == o.layout.num_stages - 1
        gatherer = o.gatherer(s, {n: self.state.params[n] for n in st.plan.params}, st.names,
                              self.leaves.setdefault(s, {}))
        size = targets.shape[0]
        if size == 0:
            _dry_forward(gatherer, last)
            self.flight[(mb, s)] = _InFlight(gatherer, None, None, 0)
            return
        inject = None
        if s > 0:
            inject = self._incoming("F", mb, s, s - 1).detach().requires_grad_(True)
        seq_dim = o.tensor_parallel.seq_dim
        seq_len = first_tensor(inputs).shape[seq_dim] if seq_dim is not None else 0
        tape = taping(o.model, dict.fromkeys(st.names), size) if o.config is not None else contextlib.nullcontext([])
        split = capturing(o.model, st.names) if o.split and o.config is None else contextlib.nullcontext(None)
        with gatherer.installed(), o.tensor_parallel.installed(seq_len), st.forward.running(s, inject), tape as calls, \
                split as captured:
            try:
                out = call_model(o.model, inputs)
            except StageExit as e:
                out = e.output
            if last:
                losses = masked_losses(o.loss_fn(out, targets), mask)  # padding rows: exactly 0
                st.forward.check_output(s, losses.detach())
                mb_sum = losses.detach().sum().to(torch.float64)
                self.loss_sum = mb_sum if self.loss_sum is None else self.loss_sum + mb_sum
                self.count = self.count + (mask.sum() if mask is not None else size)
                root = losses.sum()
            else:
                root = out
                st.forward.check_output(s, out.detach())
                self.outbox[("F", mb, s)] = out.detach()
        if captured is not None and not separable(captured):
            captured = None  # a parameter used twice in the stage: B forms its weight gradients too
        self.flight[(mb, s)] = _InFlight(gatherer, inject, root, size, calls=calls, captured=captured)

    def _backward(self, mb: int, s: int, *, weights: bool) -> None:
        rec = self.flight[(mb, s)]
        if rec.size == 0:
            _dry_backward(rec.gatherer, s == self.o.layout.num_stages - 1)
            if weights:
                self.flight.pop((mb, s))
            return
        grad_out = None
        if s < self.o.layout.num_stages - 1:
            grad_out = self._incoming("B", mb, s, s + 1)
        rec.grad_out = grad_out
        if self.o.config is not None:
            self._private_backward(mb, s, rec)
            return
        if rec.captured is not None:  # split: the input gradient now, the weight halves in W
            g_in = input_grads(rec.root, grad_out, rec.inject, rec.captured)
            if rec.inject is not None:
                self.outbox[("B", mb, s)] = g_in if g_in is not None else torch.zeros_like(rec.inject)
            return
        # no captured weight pass (fused schedule, or not separable): the weight gradients now
        names = self.o.stages[s].names
        self._backward_into_sums(rec, names, grad_out)
        if rec.inject is not None:
            g_in = rec.inject.grad if rec.inject.grad is not None else torch.zeros_like(rec.inject)
            rec.inject.grad = None
            self.outbox[("B", mb, s)] = g_in
        rec.gatherer.finish()
        if self.o.split:
            _free_all(rec.gatherer)
        rec.root = None  # W has nothing left to do
        if not self.o.split:
            self.flight.pop((mb, s))

    def _backward_into_sums(self, rec: _InFlight, names: list[str], grad_out: Tensor | None) -> None:
        """One backward from ``rec.root`` into the stage input's ``.grad`` and into the step's
        gradient sums of ``names``, the way ``AccumulateGrad`` fills ``.grad`` (what torch's own
        pipeline stages do): each parameter's gradient is added to its sum as the backward
        produces it (an owned sum is its leaf's ``.grad``, added into in place), not all of a
        microbatch's at once after it, so a rank holds one microbatch's gradient at a time and
        makes no sum of its own. A first gradient is taken only where ``AccumulateGrad`` may
        steal it, else copied. ``AccumulateGrad`` steals a view whose storage another tensor
        shares (``x.view(...)``'s gradient is the output gradient's view), so a new sum sharing
        storage with the received gradient, the input gradient to be sent, or another sum is
        copied: a sum added into in place never aliases another tensor. The same additions in
        the same order as ``_accumulate``: the same bits."""
        leaves = [rec.gatherer.full[n] for n in names]
        inputs = ([rec.inject] if rec.inject is not None else []) + leaves
        if not inputs:
            return
        views = self.sum_views
        for n, leaf in zip(names, leaves):
            if n in self.owned:  # the running sum, in the leaf's shape: added into in place
                raw, view = views.get(n, (None, None))
                if raw is not self.raw[n] or view.shape != leaf.shape:
                    raw, view = self.raw[n], self.raw[n].view(leaf.shape)
                    views[n] = (raw, view)
                leaf.grad = view
        torch.autograd.backward(rec.root, grad_out, inputs=inputs)
        g_in = rec.inject.grad if rec.inject is not None else None
        seen = None
        for n, leaf in zip(names, leaves):
            g, leaf.grad = leaf.grad, None
            if g is None:
                continue
            if n in self.owned and g is views[n][1]:
                continue  # added into the running sum in place: nothing to take
            if seen is None:
                seen = {t.untyped_storage().data_ptr() for t in (grad_out, g_in) if t is not None and t.numel()}
            if n not in self.owned:  # a new sum: its storage must be its own
                ptr = g.untyped_storage().data_ptr()
                if ptr in seen and g.numel():
                    g = g.clone()
                seen.add(g.untyped_storage().data_ptr())
            g = g.reshape(self._local_shape(n))
            if n in self.raw and n not in self.owned:  # a first gradient kept by _accumulate
                g = self.raw[n] + g
            self.raw[n] = g
            self.owned.add(n)

    def _private_backward(self, mb: int, s: int, rec: _InFlight) -> None:
        """ONE backward to the stage input and the tape's outputs; the contributions are kept
        and this stage's share of each example's squared norm computed. The weight gradients
        wait for the complete norms (``clip``)."""
        o, st = self.o, self.o.stages[s]
        inputs = (rec.inject,) if rec.inject is not None else ()
        got = fill_grads(rec.calls, rec.root, rec.grad_out, inputs)
        if rec.inject is not None:
            self.outbox[("B", mb, s)] = got[0] if got[0] is not None else torch.zeros_like(rec.inject)
        leaves = {n: rec.gatherer.full[n] for n in st.names}
        # a call no gradient reached contributes zeros: not kept (the prologue a later stage runs
        # for a parameter it shares, its output replaced by the received activation)
        flowed = [c for c in rec.calls if c.flowed]
        rec.parts = contributions(o.model, leaves, Tape(flowed, None), method=o.config.method)
        rec.calls, rec.root, rec.grad_out = None, None, None
        # the unpipelined step's cost rule: a parameter whose per-example gradients cost less to
        # form once than its Gram norm plus its clipped-sum matmul keeps them instead of its
        # factors (never more bytes than the factors: they are kept until ``clip`` either way)
        rec.parts = C.instantiate_for_reuse(rec.parts, {n: leaves[n].shape for n in rec.parts})
        rec.sq = leaves[st.names[0]].new_zeros(rec.size) if st.names else torch.zeros(rec.size, dtype=torch.float64)
        summed = {n: plist for n, plist in rec.parts.items() if n in o.partial}
        for n, plist in rec.parts.items():
            if n in o.counted and n not in o.shared and n not in summed:
                rec.sq = rec.sq + C.sq_norms(plist, leaves[n].shape)
        if summed:  # one all-reduce over tp of their [B, n] gradients (``pipeline_comm_per_step`` counts it)
            rec.sq = rec.sq + summed_sq_norms(summed, {n: leaves[n].shape for n in summed}, o.tp_norms, rec.sq)
        rec.gatherer.finish()

    def _start_norms(self, mb: int) -> None:
        """This rank's backwards of microbatch ``mb`` are done: start the all-reduce of its
        share of the microbatch's squared norms (nothing for an empty microbatch)."""
        size = self.mbs[mb][1].shape[0]
        if size == 0:
            self.norms_started[mb] = None
            return
        held = next(iter(self.state.params.values()))
        sq = torch.zeros(size, dtype=held.dtype, device=held.device)
        for s in sorted(self.o.stages):
            rec = self.flight.get((mb, s))
            if rec is not None and rec.size:
                sq += rec.sq
        self.norms_started[mb] = self.o.start_norms(sq)

    def _clip_ready(self, *, block: bool, one: bool = False) -> bool:
        """Form the clipped sums of the next microbatches, in order, whose norms are complete
        (``block``: wait for them, at the end of the step; ``one``: at most one microbatch).
        Returns whether any was formed."""
        formed = False
        while self.next_clip in self.norms_started and not (one and formed):
            mb = self.next_clip
            handle = self.norms_started[mb]
            if handle is not None and not block and not handle.done():
                return formed
            norms = handle.wait().sqrt() if handle is not None else torch.zeros(0)
            self.mb_norms[mb] = norms
            for s in sorted(self.o.stages):
                rec = self.flight.pop((mb, s), None)
                if rec is not None:
                    self._clip_record(rec, s, norms, unpack(self.mbs[mb])[2])
            self.next_clip += 1
            formed = True
        return formed

    def _clip_record(self, rec: _InFlight, s: int, norms: Tensor, mask: Tensor | None) -> None:
        """Stage ``s``'s deferred ``W`` of one microbatch: its clipped sums, from its
        contributions and its examples' complete ``norms``, added to the step's sums."""
        o = self.o
        if rec.size == 0:
            _free_all(rec.gatherer)
            return
        # nothing read here: ``clip`` reads whether any example is non-finite, once per step
        factors, parts, _ = deferred_clip_factors(norms, rec.parts, o.config.clip_norm, o.config.clipping,
                                                  o.config.nonfinite, keep=mask)
        for n in o.stages[s].names:
            if not parts.get(n):
                continue
            shape = rec.gatherer.full[n].shape
            if n in self.raw:  # a sum clip allocated: this microbatch's is added into it
                C.weighted_sum(parts[n], factors, shape, out=self.raw[n].view(shape))
            else:  # always a new tensor: the running sum
                self.raw[n] = C.weighted_sum(parts[n], factors, shape).reshape(self._local_shape(n))
        _free_all(rec.gatherer)

    def clip(self) -> None:
        """Private, after every backward: complete the shared parameters' norms where they are
        held last, all-reduce the squared norms over the pipeline (and tensor) ranks, then form
        every stage's clipped weight gradients from its contributions (its deferred ``W``).
        Without shared parameters most of this already ran in the schedule (``_clip_ready``):
        what is left waits for its norms here."""
        o = self.o
        masks = [unpack(batch)[2] for batch in self.mbs]
        keep = torch.cat(masks) if all(m is not None for m in masks) and masks else None
        if o.early_norms:
            self._clip_ready(block=True)
            norms = torch.cat([self.mb_norms[mb] for mb in range(len(self.mbs))])
            self.norms = norms if keep is None else torch.where(keep, norms, torch.zeros_like(norms))
            self._guard(norms, keep)
            return
        mine = sorted(k for k in self.flight)  # (mb, stage) still holding contributions
        self._shared_norms(mine)
        sizes = [batch[1].shape[0] for batch in self.mbs]
        held = next(iter(self.state.params.values()))
        sq = torch.zeros(sum(sizes), dtype=held.dtype, device=held.device)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for (mb, s) in mine:
            rec = self.flight[(mb, s)]
            if rec.size:
                sq[starts[mb]:starts[mb] + rec.size] += rec.sq
        norms = o.all_reduce_norms(sq).sqrt()
        self.norms = norms if keep is None else torch.where(keep, norms, torch.zeros_like(norms))
        for (mb, s) in mine:
            rec = self.flight.pop((mb, s))
            self._clip_record(rec, s, norms[starts[mb]:starts[mb] + rec.size], masks[mb])
        self._guard(norms, keep)

    def _guard(self, norms: Tensor, keep: Tensor | None) -> None:
        """The step's one read: with ``nonfinite="raise"``, raise
        :class:`NonFiniteGradientError` naming the real examples of this rank's share (their
        positions in it) whose norm is not finite, before any update (the clipped sums formed
        without reading, ``deferred_clip_factors``, are then dropped)."""
        if self.o.config.nonfinite != "raise" or norms.numel() == 0:
            return
        bad = ~torch.isfinite(norms)
        bad = bad if keep is None else bad & keep
        if bool(bad.any()):
            raise NonFiniteGradientError(bad.nonzero().flatten().tolist())

    def _shared_norms(self, mine: list[tuple[int, int]]) -> None:
        """For each parameter held by several stages: every holding rank but the last sends its
        contributions of every microbatch; the last adds the squared norm of their sum (cross
        terms included) to its share (with one holding rank, nothing moves)."""
        o = self.o
        for name, holders in sorted(o.shared.items()):
            if name not in o.counted or (o.now is not None and name not in o.now):
                continue
            last = holders[-1]
            for mb in range(len(self.mbs)):
                if self.mbs[mb][1].shape[0] == 0:
                    continue
                own = [p for (m, s) in mine if m == mb for p in (self.flight[(m, s)].parts or {}).get(name, [])]
                if o.index != last:
                    send_parts(o.comm, o.peer[last], own)
                    continue
                for j in holders[:-1]:
                    own = own + recv_parts(o.comm, o.peer[j])
                recs = [self.flight[(m, s)] for (m, s) in mine if m == mb and name in o.stages[s].names]
                if own:  # no gradient reached any holder's call: nothing to add
                    shape = recs[0].gatherer.full[name].shape
                    recs[0].sq = recs[0].sq + C.sq_norms(own, shape)
        o.comm.flush_p2p()

    def _weights(self, mb: int, s: int) -> None:
        if self.o.config is not None:
            return  # private: every W waits for the complete norms (``clip``)
        if not self.o.split:
            return  # fused schedules formed the weight gradients in B
        rec = self.flight.pop((mb, s))
        if rec.size == 0 or rec.root is None:  # empty, or its weights were formed in B
            _free_all(rec.gatherer)
            return
        st = self.o.stages[s]
        got = weight_grads(rec.captured, {n: rec.gatherer.full[n] for n in st.names})
        self._accumulate(s, [got.get(n) for n in st.names])
        rec.captured, rec.root = None, None
        rec.gatherer.finish()
        _free_all(rec.gatherer)

    def _accumulate(self, s: int, grads) -> None:
        """Add a microbatch's weight gradients to the step's sums: the first kept as autograd gave
        it (it may be another tensor's alias, so never written), then one new sum that later
        microbatches add into in place."""
        st = self.o.stages[s]
        for n, g in zip(st.names, grads):
            if g is None:
                continue
            g = g.reshape(self._local_shape(n))
            if n not in self.raw:
                self.raw[n] = g
            elif n in self.owned:
                self.raw[n].add_(g)
            else:
                self.raw[n] = self.raw[n] + g
                self.owned.add(n)

    def _local_shape(self, name: str) -> tuple[int, ...]:
        return self.o.local_shapes[name]

    def raw_grads(self) -> dict[str, Tensor]:
        out = {}
        for n in self.o.local_plan.params:
            g = self.raw.get(n)
            out[n] = g if g is not None else self.state.params[n].new_zeros(self._local_shape(n))
        return out

    def stats(self) -> Tensor | tuple[float, int, int, float]:
        """This rank's statistics (loss sum, examples, clipped, norm sum) as a device tensor
        (:func:`device_stats`, nothing read), or :data:`NO_STATS` on a rank whose losses another
        rank counts."""
        o = self.o
        # the last stage's ranks hold the losses; of a tensor-parallel group, only the first counts them
        if o.index != (o.layout.num_stages - 1) % o.p or not counts_its_share(o.plan, o.comm):
            return NO_STATS
        held = next(iter(self.state.params.values()))
        loss_sum = self.loss_sum if self.loss_sum is not None else held.new_zeros((), dtype=torch.float64)
        if self.o.config is None:
            return device_stats(loss_sum, self.count)
        norms = self.norms
        return device_stats(loss_sum, self.count, (norms > self.o.config.clip_norm).sum(), norms.sum())


class _Ready:
    """A collective with nothing to wait for (no rank to sum over)."""

    def __init__(self, out: Tensor):
        self.out = out

    def done(self) -> bool:
        return True

    def wait(self) -> Tensor:
        return self.out


def _dry_forward(g: Gatherer, last: bool) -> None:
    """The parameter collectives of a stage forward without compute: the root unit, then each
    block unit (freed after, as resharding does); the root is freed only by the last stage,
    whose forward returns through the model."""
    for unit in g.units:
        g.gather(unit)
        if unit.module and g.reshard_after_forward:
            g.free(unit)
    if last and g.reshard_after_forward:
        g.free(g.units[0])


def _dry_backward(g: Gatherer, last: bool) -> None:
    """The backward's gathers in the order hooks fire: the root first at the last stage (its
    output's gradient arrives first), then the block units in reverse."""
    order = ([g.units[0]] if last else []) + [u for u in reversed(g.units) if u.module]
    for unit in order:
        g._before_backward(unit)
        g._after_backward(unit)


def _free_all(g: Gatherer) -> None:
    for unit in g.units:
        g.free(unit)
