"""Data-parallel strategies as data: where a parameter, its gradient and its optimizer state live.

A ``Strategy`` is four layout rules, one flag and the data axes; DDP, ZeRO-1/2/3 and HSDP differ
ONLY in these values, so a runtime has one code path (``Strategy.*_transitions``) for all:

=========  ==============  ==============  ====================  ==============  ===================
strategy   param at rest   param compute   grad (reduced)        opt state       comm per step
=========  ==============  ==============  ====================  ==============  ===================
ddp        replicated      replicated      replicated (AR)       replicated      AR grads
zero1      replicated      replicated      replicated (AR)       dim 0 sharded   AR grads, AG params
zero2      replicated      replicated      dim 0 sharded (RS)    dim 0 sharded   RS grads, AG params
zero3      dim 0 sharded   replicated      dim 0 sharded (RS)    dim 0 sharded   AG fwd, AG bwd, RS
hsdp       dim 0 over      replicated      dim 0 over shard      as grad         AG fwd, AG bwd,
           shard                           (RS shard, AR         (= at rest)     RS shard, AR replica
                                           replica)
=========  ==============  ==============  ====================  ==============  ===================

zero1 follows ``torch.distributed.optim.ZeroRedundancyOptimizer``: DDP's all-reduce, each rank
steps its shard of the optimizer state, the updated shards are all-gathered (ZRO broadcasts
whole parameters from their owners instead; each rank still receives the (k-1)/k it does not
own). So zero1 keeps full gradients in memory and zero2 does not: the stages differ in data,
and the memory model shows it. (The ZeRO paper's stage 1 reduce-scatters instead; with grads
kept at the reduced layout that would be zero2 here.)

0-d parameters are always replicated (a scalar has no dim 0); a dim 0 smaller than the axis
leaves some ranks with empty shards (``torch.chunk`` semantics, ``fsdpx.sharding.layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .plan import ParamLayout, ShardingPlan, Transition
from .spec import Spec

LayoutRule = Callable[[int], Spec]
"""A tensor's layout as a function of its number of dims (so one rule covers every parameter)."""


@dataclass(frozen=True)
class ShardDim0:
    """Layout rule: a tensor of ``ndim`` dims gets dim 0 split over ``axes`` (major to minor),
    the rest whole. ``ShardDim0(())`` is the replicated rule.

    Guarantees: ``rule(0) == Spec()`` (scalars replicated) and ``rule(n).ndim == n``."""

    axes: tuple[str, ...] = ()

    def __call__(self, ndim: int) -> Spec:
        return self.over(Spec.replicated(ndim))

    def over(self, base: Spec, dim: int = 0) -> Spec:
        """The rule applied on top of a layout that tensor parallelism already chose: ``axes``
        appended as the MINOR end of dim ``dim``'s entry, so each tensor-parallel block is cut
        again over the data axes (FSDP2's sharding of a tensor-parallel shard).
        ``over(Spec.replicated(n)) == self(n)``; a 0-d ``base`` stays replicated."""
        if base.ndim == 0 or not self.axes:
            return base
        return base.with_dim(dim, base.axes(dim) + self.axes)


REPLICATED = ShardDim0(())


@dataclass(frozen=True)
class Strategy:
    """Where each tensor of a parameter lives, as layout rules ``ndim -> Spec``.

    * ``param_at_rest``: between steps (what memory holds).
    * ``param_in_compute``: during forward/backward (gathered transiently if different).
    * ``grad``: the gradient once reduced; the raw per-rank gradient is ``param_in_compute``
      made partial over ``data_axes`` (each rank saw different examples).
    * ``opt_state``: every optimizer-state tensor (the update runs in this layout).
    * ``reshard_after_forward``: free gathered params after forward and gather again in backward.
    * ``data_axes``: the mesh axes the batch is split over.

    A strategy is a plan builder: ``resolve(param_shapes)`` gives every parameter the
    ``ParamLayout`` of its dim count, and the runtime performs, per parameter, that layout's
    ``Transition``s and nothing else (``fsdpx.sharding.plan``); ``fsdpx.sharding.cost_model``
    derives bytes the same way. ``layout_over`` composes a strategy with tensor parallelism.

    Guarantees (``tests/test_strategies.py``):
      * every rule maps ``ndim == 0`` to ``Spec()``: scalars are replicated;
      * zero3 and hsdp keep optimizer state in the parameter's at-rest layout, and reduce
        gradients straight to it;
      * the stages are values of this one class: ``dataclasses.replace`` turns one into another
        (``test_zero_stages_differ_only_in_data``).
    """

    name: str
    param_at_rest: LayoutRule
    param_in_compute: LayoutRule
    grad: LayoutRule
    opt_state: LayoutRule
    reshard_after_forward: bool
    data_axes: tuple[str, ...]

    def raw_grad(self, ndim: int) -> Spec:
        """Layout of the gradient backward produces, before any reduction."""
        return self.param_in_compute(ndim).with_partial(self.data_axes)

    def layout(self, shape: Sequence[int]) -> ParamLayout:
        """The layout this strategy gives a parameter of ``shape``: each rule at its dim count."""
        n = len(shape)
        return ParamLayout(tuple(shape), self.param_at_rest(n), self.param_in_compute(n), self.raw_grad(n),
                           self.grad(n), self.opt_state(n))

    def layout_over(self, shape: Sequence[int], compute: Spec, *, dim: int = 0, tp_partial: tuple[str, ...] = (),
                    fused: tuple[int, int] | None = None) -> ParamLayout:
        """The layout of a parameter that tensor parallelism computes in ``compute``: each rule
        applied on top of it along ``dim`` (``ShardDim0.over``), the raw gradient partial over
        the data axes and ``tp_partial``. With a replicated ``compute`` and ``dim=0`` this is
        ``layout(shape)`` (``tests/test_tensor_parallel_plans.py::
        test_a_strategy_over_replicated_compute_is_the_strategy``).

        Raises ``ValueError`` for rules that are not ``ShardDim0`` (they cannot be composed)."""
        rules = (self.param_at_rest, self.param_in_compute, self.grad, self.opt_state)
        if not all(isinstance(r, ShardDim0) for r in rules):
            raise ValueError(f"strategy {self.name}: only ShardDim0 rules compose with tensor parallelism")
        at_rest, in_compute, grad, opt = (r.over(compute, dim) for r in rules)
        raw = in_compute.with_partial(tuple(self.data_axes) + tuple(tp_partial))
        return ParamLayout(tuple(shape), at_rest, in_compute, raw, grad, opt, fused)

    def resolve(self, param_shapes: Mapping[str, Sequence[int]]) -> ShardingPlan:
        """This strategy as a plan: ``layout(shape)`` for every parameter."""
        return ShardingPlan({n: self.layout(s) for n, s in param_shapes.items()}, tuple(self.data_axes),
                            self.reshard_after_forward, self.name)

    def forward_transitions(self, ndim: int) -> list[Transition]:
        """Per parameter, before the unit's forward (and again before its backward if
        ``reshard_after_forward``)."""
        return self.layout((1,) * ndim).forward_transitions()

    def backward_transitions(self, ndim: int) -> list[Transition]:
        """Per parameter, during the unit's backward: re-gather (if resharded) and reduce."""
        return self.layout((1,) * ndim).backward_transitions(self.reshard_after_forward)

    def update_transitions(self, ndim: int) -> list[Transition]:
        """Per parameter, around the optimizer step: bring grad and param to the optimizer
        state's layout, step there, then return the param to its at-rest layout."""
        return self.layout((1,) * ndim).update_transitions()


def ddp(axis: str = "dp") -> Strategy:
    r = REPLICATED
    return Strategy("ddp", r, r, r, r, reshard_after_forward=False, data_axes=(axis,))


def zero1(axis: str = "dp") -> Strategy:
    r, s = REPLICATED, ShardDim0((axis,))
    return Strategy("zero1", r, r, r, s, reshard_after_forward=False, data_axes=(axis,))


def zero2(axis: str = "dp") -> Strategy:
    r, s = REPLICATED, ShardDim0((axis,))
    return Strategy("zero2", r, r, s, s, reshard_after_forward=False, data_axes=(axis,))


def zero3(axis: str = "dp", *, reshard_after_forward: bool = True) -> Strategy:
    """FSDP (FULL_SHARD; ``reshard_after_forward=False`` is SHARD_GRAD_OP's schedule)."""
    r, s = REPLICATED, ShardDim0((axis,))
    return Strategy("zero3", s, r, s, s, reshard_after_forward=reshard_after_forward, data_axes=(axis,))


def hsdp(replica_axis: str = "replica", shard_axis: str = "shard", *, reshard_after_forward: bool = True) -> Strategy:
    """ZeRO-3 within each ``shard_axis`` group, plain replication across ``replica_axis``."""
    r, s = REPLICATED, ShardDim0((shard_axis,))
    return Strategy(
        "hsdp", s, r, s, s, reshard_after_forward=reshard_after_forward, data_axes=(replica_axis, shard_axis)
    )


ALL = {"ddp": ddp, "zero1": zero1, "zero2": zero2, "zero3": zero3, "hsdp": hsdp}
