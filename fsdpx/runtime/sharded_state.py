"""One rank's share of the train state (``ShardedState``) and how it is cut from the full
parameters before step 0 (``init_sharded``).

Each parameter is held in its plan's at-rest layout, the optimizer state in the plan's
opt_state layout (``fsdpx.sharding.plan``), both in the layout's (view) shape. ``ckpt`` stores
states without pickle, by registered type; it sits below the runtime, so this module registers
``ShardedState`` itself when it is imported
(``tests/test_ckpt_resume.py::test_sharded_runtime_resumes_bitwise_from_its_own_checkpoint``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from torch import Tensor
from torch.utils._pytree import tree_map

from ckpt.flatten import register_type
from fsdpx.optim import Optimizer
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.cost_model import PlanLike, as_plan
from fsdpx.sharding.layout import Box, local_box
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.pipeline import rank_plan
from fsdpx.sharding.spec import Spec
from privacy.accounting import Accountant
from privacy.mechanisms.correlated import NoiseHistory, empty_history
from privacy.step import DPConfig

Params = dict[str, Tensor]


class ShardedState(NamedTuple):
    """One rank's share of the train state."""

    params: Params  # at-rest layout
    opt_state: Any  # the optimizer's state over the opt_state layout
    step: int
    key: int
    accountant: Accountant | None
    # a banded mechanism's last outputs, each over the opt_state layout (privacy.mechanisms.correlated)
    noise_history: NoiseHistory = ()


# ckpt stores states without pickle, by registered type; it sits below the runtime, so the
# runtime registers its own state type.
register_type("ShardedState", ShardedState, lambda s: dict(s._asdict()), lambda d: ShardedState(**d))


def local_block(t: Tensor, spec: Spec, mesh: Mesh, rank: int) -> Tensor:
    """A contiguous copy of the block of global tensor ``t`` that ``rank`` holds under ``spec``."""
    box = local_box(tuple(t.shape), spec, mesh, rank)
    return t[tuple(slice(a, b) for a, b in box)].clone()


ReadBlock = Callable[[str, Box, "tuple[int, int] | None"], Tensor]
"""``read(name, box, fused) -> block``: the block ``box`` of parameter ``name``'s layout view
(``fused`` as ``ParamLayout.fused``), e.g. read from a file (``fsdpx.train.pretrained.read_block``)."""


def init_sharded(params: Params, optimizer: Optimizer, strategy: PlanLike, comm: Comm, *, key: int,
                 config: DPConfig | None = None, read: ReadBlock | None = None) -> ShardedState:
    """This rank's state before step 0, cut from the full ``params`` (every rank passes the same
    full values): parameters at rest, optimizer state initialised on the opt_state layout, each
    in the plan's (view) shape; a private ``config``'s empty noise history. ``strategy``: a ``Strategy`` or a resolved ``ShardingPlan``; with
    a pipeline, only the parameters of this rank's stages (``fsdpx.sharding.pipeline.rank_plan``).

    With ``read``, ``params`` give only shapes and dtypes (they may be on ``meta``) and each block
    this rank holds is ``read(name, local_box(...), fused)``; an optimizer-state block inside the
    block at rest (ZeRO-1/2, ZeRO-3) is cut from it, not read again. Guarantee: the state equals
    the one cut from the full values ``read`` reads (``tests/test_pretrained_weights.py::
    test_blocks_read_by_each_rank_equal_the_sharded_whole_model``)."""
    mesh, rank = comm.mesh, comm.rank
    plan = rank_plan(as_plan(strategy, {n: tuple(p.shape) for n, p in params.items()}), mesh, rank)
    if read is None:
        views = {n: params[n].detach().reshape(lay.shape) for n, lay in plan.params.items()}
        at_rest = {n: local_block(v, plan.params[n].at_rest, mesh, rank) for n, v in views.items()}
        at_opt = {n: local_block(v, plan.params[n].opt_state, mesh, rank) for n, v in views.items()}
    else:
        at_rest, at_opt = {}, {}
        for n, lay in plan.params.items():
            rest, opt = (local_box(lay.shape, spec, mesh, rank) for spec in (lay.at_rest, lay.opt_state))
            at_rest[n] = read(n, rest, lay.fused)
            if all(a <= c and d <= b for (a, b), (c, d) in zip(rest, opt)):  # ddp, zero1/2: inside the block at rest
                # a view, not a copy (DDP's whole parameters twice): init only reads it (own_storage below)
                at_opt[n] = at_rest[n][tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(rest, opt))]
            else:
                at_opt[n] = read(n, opt, lay.fused)
    accountant, history = None, ()
    if config is not None:
        accountant = Accountant(accountant=config.accountant, delta=config.delta, epsilon_budget=config.epsilon_budget,
                                **config.mechanism.ledger_fields)
        history = empty_history(config.mechanism)
    return ShardedState(at_rest, own_storage(optimizer.init(at_opt), at_rest), 0, key, accountant, history)


def own_storage(opt_state: Any, params: Params) -> Any:
    """``opt_state`` with every tensor that shares memory with one of ``params`` replaced by a
    copy: an optimizer whose ``init`` keeps (a view of) the parameters it was given would
    otherwise see them change under it as the step updates the parameters in place. AdamW and
    the offload optimizers make their own tensors, so nothing is copied for them
    (``tests/test_pretrained_weights.py::test_an_optimizer_that_keeps_its_input_gets_a_copy``)."""
    held = {p.untyped_storage().data_ptr() for p in params.values() if p.numel()}
    shares = lambda t: isinstance(t, Tensor) and t.numel() and t.untyped_storage().data_ptr() in held  # noqa: E731
    return tree_map(lambda t: t.clone() if shares(t) else t, opt_state)
