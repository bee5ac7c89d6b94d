"""The oracle every per-example result is judged by: a loop of ``torch.autograd.grad`` on one
example at a time, in float64.

The oracle shares no code with ``privacy/``: it never batches two examples, so no batch
broadcasting, mask or tape can leak one example into another's gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call


def loop_grads(model: nn.Module, params: dict[str, Tensor], batch: tuple[Any, Tensor],
               loss_fn: Callable[[Any, Tensor], Tensor]) -> dict[str, Tensor]:
    """The oracle: ``{name: [B, *shape]}``, example ``i``'s gradient from ``torch.autograd.grad``
    of the model run on example ``i`` alone (a batch of one)."""
    inputs, targets = batch
    names = list(params)
    rows = []
    for i in range(targets.shape[0]):
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        one = {k: v[i:i + 1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[i:i + 1]
        out = functional_call(model, live, (), one) if isinstance(one, dict) else functional_call(model, live, (one,))
        loss = loss_fn(out, targets[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, [live[k] for k in names], allow_unused=True)
        rows.append([torch.zeros_like(live[k]) if g is None else g for k, g in zip(names, grads)])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(names)}


def norms_of(per_example: dict[str, Tensor]) -> Tensor:
    """``(B,)``: each example's gradient norm over every parameter of ``per_example``."""
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_example.values()))


def clipped_sum_of(per_example: dict[str, Tensor], clip_norm: float) -> dict[str, Tensor]:
    """``sum_i min(1, C / ||g_i||) g_i`` from per-example gradients."""
    c = torch.clamp(clip_norm / norms_of(per_example), max=1.0)
    return {k: torch.einsum("b,b...->...", c, g) for k, g in per_example.items()}
