"""Per-example gradients by ``vmap(grad(...))`` over the whole model: the reference path.

Every other norm and clipping path in ``privacy/`` is tested against this one.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from privacy.tape import LossFn, Params, _as_args


def per_sample_grads(
    model: nn.Module, params: Params, batch: tuple[Any, Tensor], loss_fn: LossFn, *, chunk_size: int | None = None
) -> dict[str, Tensor]:
    """Per-example gradients ``{name: [B, *param.shape]}`` of ``loss_fn`` for each example.

    Guarantees: summing over the batch gives ``torch.autograd.grad`` of the summed loss
    (``tests/test_per_sample.py``). Parameters not in ``params`` are frozen. ``chunk_size``
    bounds memory by running ``chunk_size`` examples at a time. An empty batch gives ``[0, ...]``.
    Layers must treat examples independently (no BatchNorm in training mode)."""
    inputs, targets = batch
    args = _as_args(inputs)
    detached = {k: v.detach() for k, v in params.items()}
    if targets.shape[0] == 0:
        return {k: v.new_zeros(0, *v.shape) for k, v in detached.items()}

    def example_loss(p: Params, example_args: tuple, target: Tensor) -> Tensor:
        out = functional_call(model, p, tuple(a.unsqueeze(0) for a in example_args))
        return loss_fn(out, target.unsqueeze(0)).sum()

    return vmap(grad(example_loss), in_dims=(None, 0, 0), chunk_size=chunk_size)(detached, args, targets)


def flat_sq_norms(per_sample: dict[str, Tensor]) -> Tensor:
    """``[B]`` squared L2 norms of per-example gradients concatenated over all parameters."""
    return sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values())
