"""Ghost clipping (``privacy.clipping.clip_and_sum``) on sharded parameters: the two things the
private step needs to know beyond what ``privacy`` does on one device.

``sharded_norms``: with tensor parallelism each rank sees its part of every example's gradient,
so its share of each squared norm is completed over the ``tp`` group before any clipping.
``needs_fallback``: a module with no ghost rule is clipped by a per-module vmap that reads the
gathered parameters after the backward, so the gatherer must keep them until then. The
non-pipelined step, the pipelined one and the activation cost model
(``fsdpx.runtime.activation_cost``) ask both the same way.
"""

from __future__ import annotations

from torch import Tensor, nn

from fsdpx.sharding.collectives import cached_plan as plan_collectives
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.spec import Spec
from privacy.clipping import ShardedNorms
from privacy.layers import rule_for
from privacy.tape import owners


def sharded_norms(plan: ShardingPlan, comm: Comm) -> ShardedNorms | None:
    """With tensor parallelism, how this rank's share of each example's squared norm becomes
    the whole: parameters split over ``tp`` count on every rank (their blocks are disjoint),
    replicated ones on the rank with ``tp`` index 0 only; one all-reduce of the ``[B]`` squared
    norms over the rank's ``tp`` group completes them. Parameters whose raw gradient is partial
    over ``tp`` (sequence parallelism: each rank saw a chunk of the sequence) first have their
    per-example gradients summed over the group, one all-reduce of ``[B, their elements]``.
    ``None`` without tensor parallelism (or with a ``tp`` axis of size 1). Proven with the private
    steps it completes: ``property_tests/test_tensor_parallel_properties.py``."""
    axis = plan.tp_axis
    if axis is None or comm.mesh.axis_size(axis) == 1:
        return None
    first = comm.mesh.index(comm.rank, axis) == 0
    counted = frozenset(n for n, lay in plan.params.items() if axis in lay.compute.sharding_axes or first)
    partial = frozenset(n for n, lay in plan.params.items() if axis in lay.raw_grad.partial)
    sub = comm.mesh.sub(axis)

    def all_reduce(t: Tensor) -> Tensor:
        src = Spec.replicated(t.dim())
        (c,) = plan_collectives(src.with_partial((axis,)), src, tuple(t.shape), sub, t.dtype)
        return comm.run(c, t.contiguous())

    return ShardedNorms(counted, all_reduce, partial)


def needs_fallback(model: nn.Module, trainable) -> bool:
    """True if a module owning a trainable parameter has no ghost rule: its per-module vmap
    reads the gathered parameters after the backward, so they must stay gathered until then.
    ``trainable``: the parameter names (a mapping's keys count). Without it those runs read
    freed storage: ``tests/test_tensor_parallel_hf.py::test_every_planned_family_equals_the_unsharded_run``
    (Cohere, Cohere2 and Helium, private: their norms have no ghost rule)."""
    modules = dict(model.named_modules())
    return any(rule_for(modules[m]) is None for m in owners(model, dict.fromkeys(trainable)))
