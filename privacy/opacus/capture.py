"""The model a :class:`privacy.opacus.PrivacyEngine` hands back: it runs the user's module as it
is and remembers, per forward, what fsdpx's functional core needs to form the clipped sum.

    model = PrivateModule(net, method="ghost", loss_reduction="mean")
    loss = criterion(model(x), y)      # any criterion whose example i reads only output row i
    loss.backward()                     # records d loss / d output; no parameter gradient is formed
    batches = model.take()              # [(inputs, per-example output gradients)], for the optimizer

Why this is exact: for a loss ``L = reduce_i l_i(out_i)`` the gradient of example ``i``'s loss with
respect to the parameters is ``J_i^T (d l_i / d out_i)``, which is the gradient of the linear
loss ``<out_i, g_i>`` with ``g_i = d l_i / d out_i`` held fixed. The backward pass gives
``d L / d out_i`` (``g_i / B`` for a mean over ``B`` examples); :func:`surrogate_loss` is that
linear loss, so :func:`privacy.clipped_grad` (vmap or ghost) clips the per-example gradients of
the user's own criterion, whatever it is. The forward the user sees runs without a graph through
the parameters (``torch.no_grad``), so ``backward`` costs only the criterion's part; the model's
own backward runs once, inside the core.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from privacy.errors import PrivacyError


class Recorded:
    """One forward with gradients on: its inputs, and the gradient of the loss with respect to
    each tensor of its output, filled in by ``backward`` (``None`` until then)."""

    def __init__(self, inputs: Any, outputs: list[Tensor]) -> None:
        self.inputs = inputs
        self.grads: list[Tensor | None] = [None] * len(outputs)
        self.shapes = [o.shape for o in outputs]
        self.like = outputs[0]

    @property
    def backward_done(self) -> bool:
        return any(g is not None for g in self.grads)

    def cotangent(self, scale: float) -> Tensor:
        """The output gradients as one ``(B, total)`` tensor (zeros for an output the loss did not
        read), times ``scale``."""
        rows = self.shapes[0][0]
        parts = [(g if g is not None else self.like.new_zeros(s)).reshape(rows, -1)
                 for g, s in zip(self.grads, self.shapes)]
        return torch.cat(parts, 1) * scale


class _Capture(torch.autograd.Function):
    """Identity on one output tensor; its backward stores the incoming gradient."""

    @staticmethod
    def forward(ctx, out: Tensor, record: Recorded, index: int) -> Tensor:  # type: ignore[override]
        ctx.record, ctx.index = record, index
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        done = ctx.record.grads[ctx.index]
        ctx.record.grads[ctx.index] = grad.detach() if done is None else done + grad.detach()
        return None, None, None


def surrogate_loss(output: Any, cotangent: Tensor) -> Tensor:
    """Per example ``<out_i, g_i>`` over every floating tensor of ``output`` (in
    ``tree_flatten`` order), ``cotangent`` being their ``(B, total)`` gradients: a loss whose
    per-example parameter gradient is the one the recorded backward would have given (module
    doc). Returns a ``(B,)`` tensor."""
    outs = [o for o in tree_flatten(output)[0] if isinstance(o, Tensor) and o.is_floating_point()]
    flat = torch.cat([o.reshape(o.shape[0], -1) for o in outs], 1)
    return (flat * cotangent.to(flat.dtype)).sum(1)


def check_no_dropout(module: nn.Module) -> None:
    """Raise :class:`PrivacyError` naming the first dropout layer in training mode with ``p > 0``:
    the core recomputes the forward, and a recomputed dropout mask is not the one the loss saw."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise PrivacyError(f"privacy.opacus: dropout layer {name or type(m).__name__!r} (p={m.p}) is in training"
                               " mode; set its p to 0 or call .eval() on it (the per-example gradients recompute the"
                               " forward, and a new dropout mask would not be the one the loss saw)")


class PrivateModule(nn.Module):
    """``module`` as it is (same parameters, same outputs), recording each forward run with
    gradients enabled for the private optimizer (:meth:`take`). ``method``: how the core forms
    per-example norms ("vmap": Opacus' "hooks"; "ghost": ghost clipping). ``loss_reduction``:
    "mean" (the loss averages the examples of the batch) or "sum".

    Guarantee: after ``loss.backward()``, the clipped sum the optimizer forms equals the sum of
    the clipped per-example gradients of ``loss``'s examples (``tests/test_opacus_entry.py``).
    Edge cases: a forward under ``torch.no_grad`` (evaluation) is not recorded; a forward whose
    loss is never backpropagated is dropped at the next step; keyword and positional inputs
    together, or outputs without a floating tensor, raise :class:`PrivacyError`."""

    def __init__(self, module: nn.Module, *, method: str, loss_reduction: str) -> None:
        super().__init__()
        self._module = module
        self.method, self.loss_reduction = method, loss_reduction
        self._records: list[Recorded] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._module(*args, **kwargs)
        if args and kwargs:
            raise PrivacyError("privacy.opacus: call the model with positional or with keyword inputs, not both")
        check_no_dropout(self._module)
        with torch.no_grad():
            output = self._module(*args, **kwargs)
        leaves, spec = tree_flatten(output)
        floats = [i for i, o in enumerate(leaves) if isinstance(o, Tensor) and o.is_floating_point()]
        if not floats:
            raise PrivacyError("privacy.opacus: the model's output holds no floating tensor to differentiate")
        record = Recorded(kwargs if kwargs else args, [leaves[i] for i in floats])
        for k, i in enumerate(floats):
            leaves[i] = _Capture.apply(leaves[i].requires_grad_(True), record, k)
        self._records.append(record)
        return tree_unflatten(leaves, spec)

    def take(self) -> list[tuple[Any, Tensor]]:
        """The recorded forwards whose loss was backpropagated, as ``(inputs, cotangent)`` pairs
        (the per-example output gradients, times the batch size for a mean loss); forgets all."""
        taken = []
        for r in self._records:
            if r.backward_done:
                rows = r.shapes[0][0]
                taken.append((r.inputs, r.cotangent(float(rows) if self.loss_reduction == "mean" else 1.0)))
        self._records = []
        return taken

    @property
    def module(self) -> nn.Module:
        """The module it wraps (Opacus' ``GradSampleModule._module``)."""
        return self._module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._module.load_state_dict(*args, **kwargs)
