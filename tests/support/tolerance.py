"""How close a float64 result must be to the oracle's (``support.oracle``), for a model that is
float64 end to end and for one that computes parts in float32 (transformers' norms, softmax)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# How close two float64 results must be. transformers runs some parts of a model in float32
# whatever the model's dtype (Llama's RMSNorm upcasts, its eager attention takes the softmax with
# dtype=float32, rotary tables are built in float32). Two computations of the same value that take
# different float32 kernels there (a row padded to T against the row cut to its length; AVX2's
# vector width against AVX-512's, issue 26) may round those values apart by float32's unit
# roundoff U32 relative to them, and the gradients inherit that error relative to their own
# scale, not per element. So a model that computes in float32 is judged to F32_ULPS units of U32
# of the compared tensor's largest entry (measured: 0.02 U32 between AVX2 and AVX-512 kernels on
# Llama's eager softmax; a padding leak or a wrong clip factor is 1e-3 to 1 of the scale); a
# model that is float64 end to end keeps the float64 bound, where only summation order differs.
RTOL, ATOL = 1e-9, 1e-12
U32 = 2.0 ** -24
F32_ULPS = 4


class _Float32Ops(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64:
                self.seen.add(getattr(func, "__name__", repr(func)))
        return out


def float32_ops(model: nn.Module, inputs: Any) -> set[str]:
    """The names of the torch functions a forward of the float64 ``model`` on ``inputs`` runs
    that return a float32 (or narrower) tensor; empty when the model is float64 end to end."""
    recorder = _Float32Ops()
    with torch.no_grad(), recorder:
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return recorder.seen


def assert_close(got: Tensor, want: Tensor, float32_inside: bool, msg: str | None = None) -> None:
    """``got == want`` to the float64 bound, or, when the model computes in float32
    (``float32_ops`` not empty), to ``F32_ULPS * U32`` of ``want``'s largest entry."""
    atol = max(ATOL, F32_ULPS * U32 * want.abs().max().item()) if float32_inside else ATOL
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=msg)
