"""Per-example gradients by ``vmap(grad(...))`` over the whole model: the reference path.

Every other norm and clipping path in ``privacy/`` is tested against this one. A model whose
forward branches on tensor values (transformers checks ``attention_mask.all()`` to skip the
mask) cannot run under vmap; it runs the same ``grad`` one example at a time instead.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from privacy.batch import split_inputs, unpack
from privacy.errors import PrivacyError
from privacy.precision import compute_dtype
from privacy.tape import LossFn, Params

_UNVMAPPABLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models whose forward vmap refused once (data-dependent control flow): looped from then on."""


def per_sample_grads(
    model: nn.Module, params: Params, batch: tuple[Any, Tensor], loss_fn: LossFn, *, chunk_size: int | None = None
) -> dict[str, Tensor]:
    """Per-example gradients ``{name: [B, *param.shape]}`` of ``loss_fn`` for each example.

    Guarantees: summing over the batch gives ``torch.autograd.grad`` of the summed loss
    (``tests/test_per_sample.py``); each example's gradient equals a separate autograd run on
    that example alone (``tests/test_hf_unmodified.py``). Parameters not in ``params`` are
    frozen. ``chunk_size`` bounds memory by running ``chunk_size`` examples at a time. An empty
    batch gives ``[0, ...]``. ``inputs`` may be a mapping of keyword arguments (``{"input_ids":
    ..., "attention_mask": ...}``); every tensor in it that leads with the batch dimension is split
    along dim 0, anything else is passed to every example (``privacy.batch``). A batch's mask
    (a third entry) is not read: every row gets its gradient. Random layers (dropout) draw
    independently per example.

    Edge case: a forward that vmap refuses (``.item()``, a Python ``if`` on a tensor, an
    output of data-dependent shape) runs example by example; the model is remembered, so later
    calls loop at once. A model whose forward computes in bf16
    (:func:`privacy.precision.compute_in`) also runs example by example: autocast does not run
    under vmap. Layers must treat examples independently (no BatchNorm in training mode:
    :func:`privacy.validate.check_model`). A transformers model with activation
    checkpointing on is refused (``PrivacyError``): ``torch.func`` transforms cannot run through
    ``torch.utils.checkpoint``; ghost clipping can (``tests/test_hf_families.py``)."""
    if getattr(model, "is_activation_checkpointing", False):
        raise PrivacyError("the model has activation checkpointing on (transformers' gradient_checkpointing_enable): "
                           "per-example gradients by vmap (method='vmap') cannot run through torch.utils.checkpoint; "
                           "use method='ghost' or 'auto' (one forward, one backward: recomputation is transparent to "
                           "them), or gradient_checkpointing_disable()")
    inputs, targets, _ = unpack(batch)
    args, kwargs = split_inputs(inputs)
    detached = {k: v.detach() for k, v in params.items()}
    if targets.shape[0] == 0:
        return {k: v.new_zeros(0, *v.shape) for k, v in detached.items()}
    leaves, spec = tree_flatten((args, kwargs))
    b = targets.shape[0]
    dims = [0 if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == b else None for a in leaves]

    def example_loss(p: Params, example: list, target: Tensor) -> Tensor:
        ex_args, ex_kwargs = tree_unflatten([a if d is None else a.unsqueeze(0) for a, d in zip(example, dims)], spec)
        out = functional_call(model, p, ex_args, ex_kwargs)
        return loss_fn(out, target.unsqueeze(0)).sum()

    example_grad = grad(example_loss)
    # torch.autocast does not run under vmap(grad) (torch 2.13: a dtype mismatch in the
    # backward): a model computing in bf16 (privacy.precision) runs the same grad per example
    if model not in _UNVMAPPABLE and compute_dtype(model) is None:
        try:
            # "different": dropout (a transformers model is built in training mode) draws its own
            # mask per example, as in a batch; the default "error" refuses any random op
            return vmap(example_grad, in_dims=(None, dims, 0), chunk_size=chunk_size,
                        randomness="different")(detached, leaves, targets)
        except RuntimeError as e:
            if not str(e).startswith("vmap:"):  # functorch's own refusals all start so
                raise
            _UNVMAPPABLE.add(model)
    return _looped(example_grad, detached, leaves, dims, targets)


def _looped(example_grad: Callable, params: Params, leaves: list, dims: list, targets: Tensor) -> dict[str, Tensor]:
    """``example_grad`` on each example in turn, stacked to ``{name: [B, *shape]}``."""
    per_example = [example_grad(params, [a if d is None else a[i] for a, d in zip(leaves, dims)], targets[i])
                   for i in range(targets.shape[0])]
    return {k: torch.stack([g[k] for g in per_example]) for k in params}


def flat_sq_norms(per_sample: dict[str, Tensor]) -> Tensor:
    """``[B]`` squared L2 norms of per-example gradients concatenated over all parameters."""
    return sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values())
