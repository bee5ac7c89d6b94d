"""Per-unit parameter gathering during one forward and backward (the FSDP mechanism).

Before a unit's forward its parameters go from the at-rest layout to the compute layout
(``plan(param_at_rest, param_in_compute)``, an all-gather for ZeRO-3) and are swapped into the
module; after its forward the gathered storage is released (``reshard_after_forward``). When the
gradient of the unit's output arrives, i.e. just before its backward, the storage is gathered
again; when the gradient of its input arrives, its backward is over and the storage is released.

The gathered tensors keep their identity the whole step: autograd's saved references and the
gradient leaves stay valid, only their storage is resized to 0 and refilled, under a preserved
version counter (the data put back is bit-identical to what was saved).

Side effects (hooks on the model, storage resizes) live only inside :meth:`Gatherer.installed`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from typing import Collection, Iterator

import torch
from torch import Tensor, nn
from fsdpx.sharding.collectives import Collective, cached_plan
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import local_shape
from fsdpx.sharding.plan import ShardingPlan
from .slots import Slots
from .units import Unit


@functools.lru_cache(maxsize=65536)
def cached_local_shape(shape, spec, mesh, rank) -> tuple[int, ...]:
    """``fsdpx.sharding.layout.local_shape``, memoised: a pipeline builds a ``Gatherer`` per
    microbatch and stage, and the reduction (``fsdpx.runtime.reduce``) views every gradient in
    it. The same tuple as ``local_shape`` (a cache of a pure function of hashable arguments;
    the sharded steps that use it: ``property_tests/test_sharded_properties.py``)."""
    return local_shape(shape, spec, mesh, rank)


class Gatherer:
    """Gathers, frees and swaps in the parameters of each unit of one rank for one step."""

    def __init__(self, model: nn.Module, units: list[Unit], plan: ShardingPlan, comm: Comm,
                 at_rest: dict[str, Tensor], *, keep_after_backward: bool = False,
                 trainable: Collection[str] | None = None):
        self.model, self.units, self.comm, self.at_rest = model, units, comm, at_rest
        # this step's trainable parameters (a freezing schedule); the others are gathered the
        # same way but their leaves do not require grad, so no weight gradient is formed
        self.trainable = frozenset(plan.params if trainable is None else trainable)
        self.keep_after_backward = keep_after_backward
        self.reshard_after_forward = plan.reshard_after_forward
        self.layouts = plan.params
        self.plans: dict[str, tuple[Collective, ...]] = {
            n: cached_plan(lay.at_rest, lay.compute, lay.shape, comm.mesh, at_rest[n].dtype)
            for n, lay in plan.params.items()
        }
        # this rank's compute block of each parameter, in the layout's (view) shape
        self.local_shapes = {n: cached_local_shape(lay.shape, lay.compute, comm.mesh, comm.rank)
                             for n, lay in plan.params.items()}
        self.batched = {u.module: self._batchable(u) for u in units}  # decided once, used every gather
        self.moving = {u.module: any(self.plans[n] for n in u.params) for u in units}
        # where each alias lives in the model, resolved once (``installed`` swaps by key)
        self.slots = Slots(model, [alias for u in units for alias, _ in u.aliases])
        self._start()

    def _start(self, leaves: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
        """The state of one forward and backward: fresh leaves (those of ``leaves`` reused, see
        ``renewed``), nothing gathered."""
        self.full = {n: self._placeholder(n, leaves) for n in self.plans}
        self.live: set[str] = set()  # units whose storage is currently allocated
        self.backward_done: set[str] = set()

    def renewed(self, at_rest: dict[str, Tensor], *, trainable: Collection[str] | None = None,
                leaves: dict[str, tuple[Tensor, Tensor]] | None = None) -> "Gatherer":
        """A Gatherer for another forward and backward of the same units, plan and communicator
        (a pipeline's next microbatch or step): what was decided from the plan (collectives,
        local shapes, batching) is shared, the leaves and their state are new. Equal to
        constructing one with the same arguments (``at_rest`` with the same dtypes).

        ``leaves``: a dict shared by the Gatherers of one step (a pipeline's microbatches of one
        stage). A parameter that needs no collective gets one leaf for all of them, as a
        module's ``nn.Parameter`` is one leaf for every microbatch: its first Gatherer stores
        the leaf there, later ones with the same at-rest tensor and the same ``requires_grad``
        reuse it. The caller keeps the leaves' ``.grad`` empty between backwards and drops the
        dict at the step's end (a leaf aliases its at-rest tensor)."""
        g = copy.copy(self)
        g.at_rest = at_rest
        g.trainable = frozenset(self.layouts if trainable is None else trainable)
        g._start(leaves)
        return g

    def _moves(self, unit: Unit) -> bool:
        return self.moving[unit.module]

    def gather(self, unit: Unit) -> None:
        """Bring ``unit``'s parameters to the compute layout (no-op if already there)."""
        if unit.module in self.live:
            return
        batched = self.batched[unit.module]
        if batched:
            self._gather_batched(batched)
        for name in unit.params:
            if name in batched:
                continue
            x = self.at_rest[name]
            for c in self.plans[name]:
                x = self.comm.run(c, x)
            self._fill(name, x)
        self.live.add(unit.module)

    def _batchable(self, unit: Unit) -> list[str]:
        """The unit's parameters whose plan is one dim-0 all-gather over the unit's common axes,
        when the communicator can run them as one flat collective (``DistComm.gather_into``)
        and there are at least two; else ``[]``."""
        if not hasattr(self.comm, "gather_into"):
            return []
        names = [n for n in unit.params if len(self.plans[n]) == 1 and self.plans[n][0].kind == "all_gather"
                 and self.plans[n][0].dims == (0,)]
        if len(names) < 2 or len({self.plans[n][0].axes for n in names}) != 1:
            return []
        return names

    def _gather_batched(self, names: list[str]) -> None:
        """One flat all-gather for ``names``, written straight into their leaves' storage."""
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for n in names:
                full = self.full[n]
                full.untyped_storage().resize_(math.prod(full.shape) * full.element_size())
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(full))
            self.comm.gather_into([self.plans[n][0] for n in names], [self.at_rest[n] for n in names],
                                  [self.full[n].view(self.local_shapes[n]) for n in names])

    def _placeholder(self, name: str, leaves: dict[str, tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """The step's leaf for ``name`` in the compute layout, shaped as the module's parameter
        (a fused view merged back): an alias of the at-rest tensor when no gather is needed
        (taken from ``leaves`` when one there aliases the same tensor with the same
        ``requires_grad``, else stored there), else a tensor of the right shape whose storage
        is not allocated."""
        rest = self.at_rest[name]
        grad = name in self.trainable
        if not self.plans[name]:
            if leaves is not None:
                was, leaf = leaves.get(name, (None, None))
                if was is rest and leaf.requires_grad == grad:
                    return leaf
            leaf = rest.detach().view(self.layouts[name].param_shape(self.local_shapes[name])).requires_grad_(grad)
            if leaves is not None:
                leaves[name] = (rest, leaf)
            return leaf
        shape = self.layouts[name].param_shape(self.local_shapes[name])
        full = torch.empty(shape, dtype=rest.dtype, device=rest.device)
        full.untyped_storage().resize_(0)
        return full.requires_grad_(grad)

    def _fill(self, name: str, value: Tensor) -> None:
        full = self.full[name]
        if not self.plans[name]:
            return  # the leaf already aliases the at-rest tensor
        storage = full.untyped_storage()
        storage.resize_(math.prod(full.shape) * full.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
            full.view(value.shape).copy_(value)

    def free(self, unit: Unit) -> None:
        """Release the gathered storage of ``unit`` (kept when nothing was gathered)."""
        if unit.module not in self.live or not self._moves(unit):
            return
        for name in unit.params:
            self.full[name].untyped_storage().resize_(0)
        self.live.discard(unit.module)

    def dry_run(self) -> None:
        """The collectives of a forward and backward without compute, for a rank whose share
        of the batch is empty: every rank must take part in every collective, in the order a
        real step runs them. Forward gathers the root then each unit in order; backward starts
        at the model's output, i.e. the root, then the units in reverse."""
        for unit in self.units:
            self.gather(unit)
        for unit in self.units:
            if self.reshard_after_forward:
                self.free(unit)
        root, rest = self.units[0], self.units[1:]
        for unit in [root, *reversed(rest)]:
            self.gather(unit)
            self.backward_done.add(unit.module)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Hooks that gather/swap/free each unit around its forward and backward. A unit whose
        parameters need no collective (at rest already in the compute layout: DDP, a replicated
        parameter) has nothing to gather or free: its leaves are swapped in once, here, and it
        gets no hooks (a pipeline enters this once per microbatch and stage)."""
        slots = self.slots
        handles, swapped = [], {}
        still = {alias: self.full[name] for u in self.units if not self.moving[u.module] for alias, name in u.aliases}
        if still:
            swapped[None] = slots.swap(still)

        def pre(unit: Unit):
            def hook(module: nn.Module, args: tuple) -> None:
                self.gather(unit)
                tensors = {alias: self.full[name] for alias, name in unit.aliases}
                swapped[unit.module] = slots.swap(tensors)
                for a in args:
                    if isinstance(a, Tensor) and a.requires_grad and unit.module:
                        a.register_hook(lambda g, u=unit: self._after_backward(u))
            return hook

        def post(unit: Unit):
            def hook(module: nn.Module, args: tuple, output) -> None:
                slots.swap(swapped.pop(unit.module))
                if self.reshard_after_forward:
                    self.free(unit)
                for t in torch.utils._pytree.tree_leaves(output):
                    if isinstance(t, Tensor) and t.requires_grad:
                        t.register_hook(lambda g, u=unit: self._before_backward(u))
            return hook

        try:
            for unit in self.units:
                if not self.moving[unit.module]:
                    continue
                m = self.model.get_submodule(unit.module)
                handles.append(m.register_forward_pre_hook(pre(unit)))
                handles.append(m.register_forward_hook(post(unit)))
            yield
        finally:
            for h in handles:
                h.remove()
            for saved in swapped.values():
                slots.swap(saved)

    def _before_backward(self, unit: Unit) -> None:
        if unit.module not in self.backward_done:
            self.gather(unit)

    def _after_backward(self, unit: Unit) -> None:
        if unit.module not in self.backward_done:
            self.backward_done.add(unit.module)
            if not self.keep_after_backward:
                self.free(unit)

    def full_view(self) -> dict[str, Tensor]:
        """The compute-layout leaves of this step's trainable parameters by canonical name, in
        unit order (storage allocated only while their unit is gathered)."""
        return {n: self.full[n] for u in self.units for n in u.params if n in self.trainable}

    def finish(self) -> None:
        """End of step: every unit's backward gather happened exactly once (a unit whose
        output never met the loss is gathered here so all ranks run the same collectives),
        then all storage is released."""
        for unit in reversed(self.units):
            if self.reshard_after_forward and unit.module not in self.backward_done and unit.module not in self.live:
                self.gather(unit)
            self.backward_done.add(unit.module)
        for unit in self.units:
            self.free(unit)
