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

import threading
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""``--precision`` -> the dtype the forward computes in (``None``: no autocast)."""

REDUCED = (torch.bfloat16, torch.float16)

_DTYPE = "_fsdpx_compute_dtype"  # on the model: the dtype its forward computes in (None: fp32)
_HOOKED = "_fsdpx_precision_hooked"  # on the model: the hooks below are registered
_open = threading.local()  # per thread, the autocast contexts of the forwards under way


def compute_in(model: nn.Module, precision: str) -> nn.Module:
    """``model``, its forward now running under ``torch.autocast`` to ``precision``'s dtype on
    the device of its first tensor input, its floating outputs cast back to fp32; ``"fp32"``
    turns that off. Returns ``model`` (the same object). The switch is a pair of forward hooks
    on the root module (registered once; ``copy.deepcopy`` keeps them, as the simulated ranks
    copy the model) that read the dtype at each call; the post-hook runs even when the forward
    raises (a pipeline stage ends its forward so), so autocast never stays on. Parameters,
    buffers and the state dict are not touched. Raises ``ValueError`` for a precision not in
    :data:`PRECISIONS`.

    Guarantee (``tests/test_precision.py::test_bf16_forward_runs_in_bf16_and_the_state_stays_fp32``):
    a Linear inside the forward returns bf16; the parameters' gradients, the parameters and the
    optimizer's moments after a step are fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if PRECISIONS[precision] is None and not getattr(model, _HOOKED, False):
        return model  # fp32 on a model never switched: left exactly as it was
    setattr(model, _DTYPE, PRECISIONS[precision])
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_enter, with_kwargs=True)
        model.register_forward_hook(_leave, always_call=True)
        setattr(model, _HOOKED, True)
    return model


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`compute_in` set ``model``'s forward to compute in; ``None`` for fp32."""
    return getattr(model, _DTYPE, None)


def exact(t: Any) -> Any:
    """``t`` upcast to fp32 when it is a bf16 or fp16 tensor, else ``t`` itself (ids, fp32 and
    fp64 tensors, non-tensors): what a norm or a clipped sum is computed from."""
    if isinstance(t, Tensor) and t.dtype in REDUCED:
        return t.float()
    return t


def exact_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`exact` gives a tensor of ``dtype``: fp32 for bf16 and fp16, else ``dtype``."""
    return torch.float32 if dtype in REDUCED else dtype


def _enter(model: nn.Module, args: tuple, kwargs: dict) -> None:
    dtype = getattr(model, _DTYPE, None)
    context = torch.autocast(_device_type(args, kwargs), dtype=dtype) if dtype is not None else None
    if context is not None:
        context.__enter__()
    _open.__dict__.setdefault("stack", []).append(context)


def _leave(model: nn.Module, args: tuple, output: Any) -> Any:
    context = _open.stack.pop()
    if context is None:
        return None
    context.__exit__(None, None, None)
    return tree_map(exact, output)


def _device_type(args: tuple, kwargs: dict) -> str:
    """The device type of the first tensor among the call's inputs (``"cpu"`` without one)."""
    leaves = tree_flatten((args, kwargs))[0]
    return next((t.device.type for t in leaves if isinstance(t, Tensor)), "cpu")
