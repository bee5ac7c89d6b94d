"""Mixed precision: the model's forward computes in bf16, everything after it in fp32.

    compute_in(model, "bf16")   # from now on model(...) runs under CPU/CUDA autocast to bf16

One mechanism for every layout: each step (plain or private, one process, ZeRO, tensor or
pipeline parallel) runs the model through its root ``forward`` (``functional_call``, the sharded
runtime's ``call_model``, a pipeline stage's forward), so wrapping that one method puts every
layout's forward under ``torch.autocast``. The parameters stay what the state holds (fp32
masters); autocast casts them to bf16 at each matmul, so autograd returns fp32-typed gradients
for them. Nothing after the forward runs under autocast: the model's floating outputs are cast
back to fp32 before the loss; the ghost tape upcasts the bf16 activations and output gradients
it captured before any norm or clipped sum is formed (:func:`exact`, in
``privacy.tape.fill_grads``); clip factors, clipped sums, noise and the optimizer's moments are
fp32. So clipping never sees a bf16-rounded norm: each example's norm is the fp32 norm of the
contributions the clipped sum adds up.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""``--precision`` -> the dtype the forward computes in (``None``: no autocast)."""

REDUCED = (torch.bfloat16, torch.float16)

_MARK = "_fsdpx_compute_dtype"  # set on the wrapper: the dtype it computes in, and the forward it wraps


def compute_in(model: nn.Module, precision: str) -> nn.Module:
    """``model``, its ``forward`` now running under ``torch.autocast`` to ``precision``'s dtype
    on the device of its first tensor input, its floating outputs cast back to fp32. Returns
    ``model`` (the same object). Idempotent: a second call replaces the first's wrapper, and
    ``"fp32"`` restores the forward as it was. Parameters, buffers and the state dict are not
    touched. Raises ``ValueError`` for a precision not in :data:`PRECISIONS`.

    Guarantee (``tests/test_precision.py::test_bf16_forward_runs_in_bf16_and_masters_stay_fp32``):
    a Linear inside the forward returns bf16; the parameters' gradients are fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    inner = model.__dict__.get("forward")
    if inner is not None and hasattr(inner, _MARK):
        inner = getattr(inner, _MARK)[1]
        if inner is None:
            del model.forward
        else:
            model.forward = inner
    dtype = PRECISIONS[precision]
    if dtype is None:
        return model
    original = model.__dict__.get("forward")
    wrapped = _autocast_forward(model.forward, dtype)
    setattr(wrapped, _MARK, (dtype, original))
    model.forward = wrapped
    return model


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`compute_in` set ``model``'s forward to compute in; ``None`` for fp32."""
    forward = model.__dict__.get("forward")
    mark = getattr(forward, _MARK, None)
    return mark[0] if mark is not None else None


def exact(t: Any) -> Any:
    """``t`` upcast to fp32 when it is a bf16 or fp16 tensor, else ``t`` itself (ids, fp32 and
    fp64 tensors, non-tensors): what a norm or a clipped sum is computed from."""
    if isinstance(t, Tensor) and t.dtype in REDUCED:
        return t.float()
    return t


def exact_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`exact` gives a tensor of ``dtype``: fp32 for bf16 and fp16, else ``dtype``."""
    return torch.float32 if dtype in REDUCED else dtype


def _autocast_forward(forward: Callable, dtype: torch.dtype) -> Callable:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(_device_type(args, kwargs), dtype=dtype):
            out = forward(*args, **kwargs)
        return tree_map(exact, out)

    return run


def _device_type(args: tuple, kwargs: dict) -> str:
    """The device type of the first tensor among the call's inputs (``"cpu"`` without one)."""
    leaves = tree_flatten((args, kwargs))[0]
    return next((t.device.type for t in leaves if isinstance(t, Tensor)), "cpu")
