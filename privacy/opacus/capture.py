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

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from privacy.errors import PrivacyError
from privacy.per_sample import per_sample_grads
from privacy.validate import check_model


class Recorded:
    """One forward with gradients on: its inputs, and the gradient of the loss with respect to
    each tensor of its output, filled in by ``backward`` (``None`` until then)."""

    def __init__(self, inputs: Any, outputs: list[Tensor], on_backward: Callable[[Recorded], None] | None = None
                 ) -> None:
        self.inputs = inputs
        self.grads: list[Tensor | None] = [None] * len(outputs)
        self.shapes = [o.shape for o in outputs]
        self.like = outputs[0]
        self.on_backward = on_backward  # called once at the end of each backward through the record
        self.queued = False
        self.per_sample: dict[str, Tensor] | None = None  # formed by on_backward (vmap modes)

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
        record = ctx.record
        done = record.grads[ctx.index]
        record.grads[ctx.index] = grad.detach() if done is None else done + grad.detach()
        if record.on_backward is not None and not record.queued:
            record.queued = True  # once every output's gradient is in: at the end of this backward
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _backward_ended(record))
        return None, None, None


def _backward_ended(record: Recorded) -> None:
    record.queued = False
    record.on_backward(record)


class Taken(NamedTuple):
    """A recorded forward whose loss was backpropagated: its ``inputs``, the per-example output
    gradients ``cotangent`` (``(B, total)``), and the per-example parameter gradients formed at
    ``backward`` (vmap modes; ``None`` in the ghost modes)."""

    inputs: Any
    cotangent: Tensor
    per_sample: dict[str, Tensor] | None


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
        self.clear_grad_samples()

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
        record = Recorded(kwargs if kwargs else args, [leaves[i] for i in floats],
                          self._form_grad_samples if self.method == "vmap" else None)
        for k, i in enumerate(floats):
            leaves[i] = _Capture.apply(leaves[i].requires_grad_(True), record, k)
        self._records.append(record)
        return tree_unflatten(leaves, spec)

    def take(self) -> list[Taken]:
        """The recorded forwards whose loss was backpropagated (:class:`Taken`: the cotangent is
        the per-example output gradients, times the batch size for a mean loss); forgets all."""
        taken = [Taken(r.inputs, r.cotangent(self._scale(r)), r.per_sample) for r in self._records if r.backward_done]
        self._records = []
        return taken

    def _scale(self, record: Recorded) -> float:
        return float(record.shapes[0][0]) if self.loss_reduction == "mean" else 1.0

    def trainable(self) -> dict[str, nn.Parameter]:
        """The module's parameters that require grad, by canonical name."""
        return {n: p for n, p in self._module.named_parameters() if p.requires_grad}

    def clear_grad_samples(self) -> None:
        """``p.grad_sample = None`` on every trainable parameter (Opacus' value when none is
        formed: always in the ghost modes, and after ``zero_grad``)."""
        for p in self.trainable().values():
            p.grad_sample = None

    def _form_grad_samples(self, record: Recorded) -> None:
        """Opacus' ``p.grad_sample`` in the vmap modes, at the end of the backward: each trainable
        parameter's per-example gradients ``[B, *shape]`` of each example's own loss (a mean
        loss not divided by the batch size, as Opacus' are), by
        :func:`privacy.per_sample.per_sample_grads`; kept on the record for the optimizer's
        clipping (:func:`privacy.clipping.clip_per_sample`: formed once). A second forward and
        backward before ``zero_grad`` appends its rows along dim 0."""
        check_model(self._module)
        trainable = self.trainable()
        params = {n: p.detach() for n, p in trainable.items()}
        with torch.enable_grad():
            record.per_sample = per_sample_grads(self._module, params, (record.inputs, record.cotangent(
                self._scale(record))), surrogate_loss)
        for n, p in trainable.items():
            g, old = record.per_sample[n], getattr(p, "grad_sample", None)
            p.grad_sample = g if old is None else torch.cat([old, g])

    @property
    def module(self) -> nn.Module:
        """The module it wraps (Opacus' ``GradSampleModule._module``)."""
        return self._module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._module.load_state_dict(*args, **kwargs)
