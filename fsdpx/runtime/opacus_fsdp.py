"""Opacus' FSDP path over fsdpx's ZeRO-3: ``FSDP2Wrapper`` and what ``make_private(...,
grad_sample_mode="ghost_fsdp")`` builds on it, in every rank of a torchrun job.

    import torch.distributed as dist
    from fsdpx.runtime.opacus_fsdp import FSDP2Wrapper   # was: from opacus.utils.fsdp_utils import FSDP2Wrapper
    from privacy.opacus import PrivacyEngine             # was: from opacus import PrivacyEngine

    dist.init_process_group("gloo")                      # the user's, as with Opacus (NCCL on GPUs)
    model = FSDP2Wrapper(model)                          # parameters now this rank's ZeRO-3 shards
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode="ghost_fsdp")
    for x, y in loader:                                  # this rank's rows of each Poisson batch
        optimizer.zero_grad(); criterion(model(x), y).backward(); optimizer.step()

The wrapper cuts each parameter's dim-0 block (``fsdpx.sharding.strategies.zero3``) and puts it
in the module in place of the parameter, so ``model.parameters()`` are this rank's shards and the
user's optimizer (its state too) lives on them. A forward gathers each unit's whole parameters
as it runs (``fsdpx.runtime.gather.Gatherer``) and frees them after. The private optimizer
(:class:`ShardedDPOptimizer`) is :class:`privacy.opacus.DPOptimizer` whose ``pre_step`` runs
``fsdpx.runtime.make_sharded_step`` on this rank's recorded rows (``local_batch=True``): ghost
clipping of the local examples, clipped sums reduce-scattered, each rank's shard of the
one-process noise (``fsdpx.runtime.owned_noise``), and each shard's ``.grad`` set; the user's
optimizer then steps the shards. A rank that dies is named by the others' next collective
(``fsdpx.runtime.dist_comm``: ``RankFailure`` within a grace period).

``fsdpx`` is a layer above ``privacy``, so ``privacy.opacus`` cannot import this module: the
engine finds :meth:`ShardedModule.private_optimizer` on the module it is given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdpx.optim import Optimizer
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.strategies import zero3
from privacy.accounting import Accountant
from privacy.errors import PrivacyError
from privacy.opacus.capture import PrivateModule, Taken, surrogate_loss
from privacy.opacus.optimizer import DPOptimizer
from privacy.step import DPConfig

from .dist_comm import init_from_env
from .gather import Gatherer
from .sharded_state import ShardedState, init_sharded
from .step import make_sharded_step
from .units import make_units


class ShardedModule(nn.Module):
    """``module`` with its parameters replaced by this rank's ZeRO-3 blocks (one ``nn.Parameter``
    per canonical parameter, tied uses sharing it); a forward gathers whole parameters unit by
    unit and frees them after (an evaluation forward: no gradient reaches the shards; training
    goes through ``make_private(..., grad_sample_mode="ghost_fsdp")``). Made by :func:`FSDP2Wrapper`."""

    def __init__(self, module: nn.Module, comm: Comm, plan: ShardingPlan, shapes: dict[str, tuple[int, ...]],
                 shards: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self._module = module
        self.comm, self.plan, self.shapes, self.shards = comm, plan, shapes, shards
        self.units = make_units(module, shapes)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (its parameters are the shards)."""
        return self._module

    @property
    def share(self) -> tuple[int, int]:
        """``(rank, ranks)``: this rank's place among the data-parallel ranks."""
        return self.comm.rank, self.comm.mesh.size

    def at_rest(self) -> dict[str, Tensor]:
        """The shards as the runtime holds them (detached aliases: an update of a shard shows)."""
        return {n: p.detach() for n, p in self.shards.items()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        gatherer = Gatherer(self._module, self.units, self.plan, self.comm, self.at_rest(), trainable=())
        try:
            with gatherer.installed():
                return self._module(*args, **kwargs)
        finally:
            for unit in self.units:
                gatherer.free(unit)

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter whole, by canonical name (every rank must call it: it all-gathers)."""
        gatherer = Gatherer(self._module, self.units, self.plan, self.comm, self.at_rest(), trainable=())
        out = {}
        for unit in self.units:
            gatherer.gather(unit)
            out.update({n: gatherer.full[n].detach().clone() for n in unit.params})
            gatherer.free(unit)
        return out

    def agreed_key(self, key: int) -> int:
        """Rank 0's ``key`` on every rank (the noise and the batches need one key everywhere)."""
        return int(self.comm.all_gather_object(int(key))[0])

    def private_optimizer(self, optimizer: torch.optim.Optimizer, model: PrivateModule, **kwargs: Any) -> DPOptimizer:
        """The private optimizer of ``grad_sample_mode="ghost_fsdp"`` (:class:`ShardedDPOptimizer`;
        ``kwargs`` as :class:`privacy.opacus.DPOptimizer`'s, plus ``sample_rate`` and
        ``num_examples``). Called by ``privacy.opacus.PrivacyEngine.make_private``."""
        return ShardedDPOptimizer(optimizer, model, self, **kwargs)


def FSDP2Wrapper(model: nn.Module, **kwargs: Any) -> ShardedModule:  # noqa: N802 - Opacus' name
    """Opacus' ``FSDP2Wrapper``: ``model`` sharded ZeRO-3 over every rank of the process group
    the user initialised under torchrun (``torch.distributed.init_process_group``, gloo on the
    CPU, NCCL on GPUs: the parameters' device decides); returns a :class:`ShardedModule` whose
    ``parameters()`` are this rank's blocks. ``model`` itself is changed (its parameters become
    the blocks), as Opacus' ``fully_shard`` changes it. Every rank passes the same ``model`` (same
    seed or same weights). A peer that dies is named by the next collective within 10 s
    (``fsdpx.runtime.dist_comm``); one that hangs, within the process group's own timeout.
    Opacus' ``mp_policy`` / ``opacus_high_precision_layers`` are refused by name
    (:class:`PrivacyError`), as are parameters with ``requires_grad=False`` and a process group
    that is not initialised. Guarantee: the private steps equal the one-process entry's on the
    union of the ranks' rows, noise included (``tests/test_opacus_fsdp.py``)."""
    if kwargs:
        raise PrivacyError(f"FSDP2Wrapper: argument {sorted(kwargs)[0]!r} is not supported: parameters keep their"
                           " dtype (no mixed precision policy)")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise PrivacyError(f"FSDP2Wrapper: parameter {frozen[0]!r} has requires_grad=False; frozen parameters are"
                           " not supported with grad_sample_mode='ghost_fsdp' (fsdpx train's freeze setting is)")
    if not dist.is_initialized():
        raise PrivacyError("FSDP2Wrapper: call torch.distributed.init_process_group first (under torchrun)")
    device = next(model.parameters()).device
    comm = init_from_env(Mesh(dp=dist.get_world_size()), device=device)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = zero3().resolve(shapes)
    state = init_sharded({n: p.detach() for n, p in model.named_parameters()}, _NO_STATE, plan, comm, key=0)
    shards = {n: nn.Parameter(t) for n, t in state.params.items()}
    canonical = {id(p): n for n, p in model.named_parameters()}
    for alias, p in list(model.named_parameters(remove_duplicate=False)):
        prefix, _, attr = alias.rpartition(".")
        model.get_submodule(prefix)._parameters[attr] = shards[canonical[id(p)]]
    return ShardedModule(model, comm, plan, shapes, shards)


_NO_STATE = Optimizer(init=lambda params: {}, update=lambda grads, state, params: (params, state))
"""The runtime's optimizer when the user's torch optimizer does the update: no state of its own."""


def shard_grads(shards: dict[str, nn.Parameter], scale: float) -> Optimizer:
    """An optimizer for ``make_sharded_step`` that only sets each shard's ``.grad`` to
    ``scale`` times its noisy clipped sum (``make_sharded_step`` has divided by ``q N``) and leaves
    the parameters as they are: the user's torch optimizer steps them next."""
    def update(grads: dict[str, Tensor], state: Any, params: dict[str, Tensor]) -> tuple[dict[str, Tensor], Any]:
        for name, g in grads.items():
            p = shards[name]
            p.grad = (g * scale).reshape(p.shape).to(p.dtype)
        return params, state

    return Optimizer(init=lambda params: {}, update=update)


def joined(records: list[Taken]) -> tuple[Any, Tensor]:
    """The recorded batches of one logical step as one batch ``(inputs, cotangent)``: tensors
    leading with each record's rows concatenated, everything else taken from the first (they
    must agree). No record: an empty batch (the rank still takes part in every collective).
    Raises :class:`PrivacyError` if the records' inputs differ in structure."""
    if not records:
        return (), torch.zeros(0, 1)
    if len(records) == 1:
        return records[0].inputs, records[0].cotangent
    flat = [tree_flatten(r.inputs) for r in records]
    if any(spec != flat[0][1] for _, spec in flat):
        raise PrivacyError("privacy.opacus: the physical batches of one step call the model with different inputs")
    leaves = []
    for i, first in enumerate(flat[0][0]):
        parts = [f[0][i] for f in flat]
        rows = [r.cotangent.shape[0] for r in records]
        cut = isinstance(first, Tensor) and all(isinstance(t, Tensor) and t.dim() and t.shape[0] == r
                                                for t, r in zip(parts, rows))
        leaves.append(torch.cat(parts) if cut else first)
    return tree_unflatten(leaves, flat[0][1]), torch.cat([r.cotangent for r in records])


class ShardedDPOptimizer(DPOptimizer):
    """:class:`privacy.opacus.DPOptimizer` for a :class:`ShardedModule`: ``pre_step`` runs the
    sharded private step on the rows this rank recorded since the last step (the physical
    batches of a logical one joined) and sets each shard's ``.grad`` to its noisy clipped sum
    over the expected batch size (mean) or as it is (sum); ``step()`` then steps the user's
    optimizer on the shards. The noise key is this step's on every rank (``key`` agreed by the
    engine), so the noise is the one-process entry's, bit for bit, whatever the ranks."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: PrivateModule, sharded: ShardedModule, *,
                 sample_rate: float, num_examples: int, **kwargs: Any) -> None:
        super().__init__(optimizer, model, **kwargs)
        self.sharded, self._pending = sharded, []
        divisor = sample_rate * num_examples  # what make_sharded_step divides by
        scale = divisor / self.expected_batch_size if self.loss_reduction == "mean" else divisor
        config = DPConfig(clip_norm=self.max_grad_norm, noise_multiplier=self.noise_multiplier,
                          sample_rate=sample_rate, method="ghost", clipping="opacus_flat", accountant="rdp")
        self._step = make_sharded_step(sharded.module, surrogate_loss, shard_grads(sharded.shards, scale),
                                       sharded.plan, sharded.comm, param_shapes=sharded.shapes, config=config,
                                       num_examples=num_examples, local_batch=True)
        self._accountant = Accountant(accountant="rdp", delta=config.delta)

    def physical_pieces(self, rows: int, size: int) -> int:
        """The most physical batches any rank cuts its rows into: each physical batch's forward
        gathers parameters, so every rank must run as many (a rank with fewer rows gets
        smaller or empty ones)."""
        return max(self.sharded.comm.all_gather_object(super().physical_pieces(rows, size)))

    def accumulate(self) -> None:
        """Keep the batches recorded since the last call for the next real step."""
        self._pending += self.module.take()

    def form_gradient(self) -> None:
        """The clipped sum and noise of the recorded batches, formed by the sharded step over
        every rank (module doc): every rank must step together."""
        batch, self._pending = joined(self._pending), []
        state = ShardedState(self.sharded.at_rest(), {}, self.steps, self.noise_key, self._accountant)
        self._step(state, batch)
