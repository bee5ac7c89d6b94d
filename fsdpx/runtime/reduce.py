"""The end of a sharded step, after the backward: reduce each gradient, add the private noise,
divide, update, and return the parameters to rest.

Per unit in reverse order: reduce the raw gradient (``plan(raw_grad, grad)``), bring it and the
parameter to the optimizer-state layout; private: add the noise of exactly the elements this
rank updates (``fsdpx.runtime.owned_noise.OwnedNoise``); divide by ``gradient_divisor`` (``q N``
private, the global batch size plain); then the elementwise optimizer on the local slice
(``trainable_update``), and back to the at-rest layout. The non-pipelined step
(``fsdpx.runtime.step``) and the pipelined one (``fsdpx.runtime.pipeline``) both end here.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

from torch import Tensor

from fsdpx.optim import Optimizer, update_fn
from fsdpx.optim.freezing import TrainableSets, frozen_update
from fsdpx.sharding.collectives import cached_plan as plan_collectives
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.plan import ShardingPlan
from privacy.batch import real_count
from privacy.step import DPConfig

from .gather import cached_local_shape
from .owned_noise import OwnedNoise
from .replicas import ReplicaCheck
from .sharded_state import Params, ShardedState
from .units import Unit


def trainable_update(optimizer: Optimizer, donate: bool, sets: TrainableSets | None) -> Callable:
    """The step's update: ``fsdpx.optim.update_fn``, through ``frozen_update`` under a
    freezing schedule (per-parameter counts from the first step on, frozen ones untouched)."""
    update = update_fn(optimizer, donate=donate)
    return update if sets is None else frozen_update(optimizer, update)


def gradient_divisor(batch: tuple, config: DPConfig | None, num_examples: int | None) -> float:
    """``q N`` (private), or the global number of real examples (plain; at least 1, so an
    empty batch divides by 1)."""
    if config is not None:
        return config.sample_rate * num_examples
    return float(max(real_count(batch), 1))


def reduce_and_update(raw: Params, state: ShardedState, plan: ShardingPlan, comm: Comm, units: list[Unit],
                      update: Callable, divisor: float, noise: OwnedNoise | None,
                      trainable: Collection[str] | None = None, replicas: ReplicaCheck | None = None
                      ) -> tuple[Params, Any, int]:
    """Reduce, noise and update: ``(new at-rest params, new optimizer state, resident bytes)``.
    ``raw`` (popped as it is reduced: a lazy sum is formed then, and freed once reduced) holds
    each trainable parameter's raw gradient. ``trainable`` (a freezing schedule's set of this
    step): the other parameters move nothing (no reduce, no noise, no update, no return to rest:
    their at-rest block is unchanged; ``fsdpx.comm_per_step(..., trainable=)`` counts exactly
    this) and keep their tensors and optimizer state; ``update`` is then an
    ``fsdpx.optim.update_trainable`` one, which returns them untouched. ``replicas`` (the first
    step's ``ReplicaCheck``) sees every reduced gradient, and compares before the update.
    Proven with the steps it ends: ``property_tests/test_sharded_properties.py``,
    ``property_tests/test_freezing_properties.py``."""
    mesh = comm.mesh
    trains = (lambda n: True) if trainable is None else frozenset(trainable).__contains__
    grads_upd, params_upd = {}, {}
    grad_bytes = 0
    for unit in reversed(units):
        for name in unit.params:
            g = raw.pop(name, None) if trains(name) else None  # formed (if lazy) and freed once reduced
            if g is None:  # frozen: no gradient
                continue
            lay = plan.params[name]
            g = g.reshape(cached_local_shape(lay.shape, lay.compute, mesh, comm.rank))  # the layout's view
            g = _run_plan(comm, plan_collectives(lay.raw_grad, lay.grad, lay.shape, mesh, g.dtype), g)
            if replicas is not None:
                replicas.add(plan, name, g)
            grad_bytes += g.numel() * g.element_size()
            g = _run_plan(comm, plan_collectives(lay.grad, lay.opt_state, lay.shape, mesh, g.dtype), g)
            if noise is not None:
                g = noise.add_to(name, g)  # drawn now: one parameter's noise alive at a time
            grads_upd[name] = g if noise is not None else g / divisor
            p = state.params[name]
            params_upd[name] = _run_plan(comm, plan_collectives(lay.at_rest, lay.opt_state, lay.shape, mesh, p.dtype), p)
    if noise is not None:
        noise.settle(grads_upd)  # device draws: one read for all of them
        for n in grads_upd:  # one at a time: each undivided sum is freed as its quotient is made
            grads_upd[n] = grads_upd[n] / divisor
    if replicas is not None:
        replicas.finish()  # a plan that does not fit the model stops here, before anything changes
    order = list(state.params)
    # a frozen parameter goes in at rest, as it is: the update (frozen_update) hands it back untouched
    new_upd, opt_state = update({n: grads_upd[n] for n in order if n in grads_upd}, state.opt_state,
                                {n: params_upd.get(n, state.params[n]) for n in order})
    new_params = {}
    for name in order:
        lay = plan.params[name]
        new_params[name] = state.params[name] if name not in grads_upd else _run_plan(
            comm, plan_collectives(lay.opt_state, lay.at_rest, lay.shape, mesh, new_upd[name].dtype), new_upd[name])
    resident = grad_bytes + tensor_bytes(new_params) + tensor_bytes(opt_state)
    return new_params, opt_state, resident


def tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested structure of dicts, lists and tuples."""
    if isinstance(tree, Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def _run_plan(comm: Comm, collectives, x: Tensor) -> Tensor:
    for c in collectives:
        x = comm.run(c, x)
    return x
