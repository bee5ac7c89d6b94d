"""The weight-gradient pass split from the input-gradient pass (zero-bubble schedules' ``W``).

During a stage's forward, the outputs of every module that owns one of the stage's parameters
are kept (``capturing``). ``B`` then runs ONE backward from the stage output to the stage input
AND to those module outputs (their gradients ``dy``), computing no weight gradient; ``W`` later
asks autograd, module by module, for the gradient of its parameters from ``(y, dy)``
(``weight_grads``), which walks only the nodes between the module's output and its own
parameters: the weight halves of the backward that ``B`` skipped. Together they compute what one
fused backward computes, with nothing done twice.

That holds when each parameter is used by one module call of the stage (a tied embedding and head
in ONE stage would also be reached through the earlier call): ``capturing`` reports it, and the
caller then forms the weight gradients in ``B`` instead (``tests/test_pipeline.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from privacy.tape import owners


@dataclass
class Captured:
    """One call of a parameter-owning module: its parameters' canonical names (with the local
    names they have in the module), its output tensors, and (after ``B``) their gradients."""

    params: dict[str, str]  # local name -> canonical name
    outputs: list[Tensor]
    grads: list[Tensor | None] = field(default_factory=list)


@contextlib.contextmanager
def capturing(model: nn.Module, names: Iterable[str]) -> Iterator[list[Captured]]:
    """Inside, every call of a module owning one of ``names`` is appended to the yielded list,
    with its FINAL output: after the forward hooks registered before this context (a
    tensor-parallel row layer adds its bias after the all-reduce, in a hook), so every use of
    the module's parameters lies between its output and them."""
    table = owners(model, dict.fromkeys(names))
    calls: list[Captured] = []
    modules = dict(model.named_modules())

    def hook_for(direct: dict[str, str]):
        def hook(module: nn.Module, args: tuple, output) -> None:
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            if outs:
                calls.append(Captured(dict(direct), outs))
        return hook

    handles = [modules[m].register_forward_hook(hook_for(direct)) for m, direct in table.items()]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def separable(calls: list[Captured]) -> bool:
    """Is every parameter used by exactly one captured call (so per-call weight passes never
    reach another call's use of it)?"""
    seen: set[str] = set()
    for c in calls:
        for name in c.params.values():
            if name in seen:
                return False
            seen.add(name)
    return True


def input_grads(root: Tensor, grad_root: Tensor | None, inject: Tensor | None, calls: list[Captured]) -> Tensor | None:
    """``B``: one backward from ``root`` (seeded with ``grad_root``) to ``inject`` and every
    captured output, keeping the graph for ``W``; each call gets its outputs' gradients.
    Returns the gradient of ``inject`` (None when there is none or it got none)."""
    ys = [y for c in calls for y in c.outputs]
    inputs = ([inject] if inject is not None else []) + ys
    if not inputs:
        return None
    with torch._C.DisableTorchFunctionSubclass():  # outputs may be tensor subclasses (vocab-sharded logits)
        got = torch.autograd.grad(root, inputs, grad_root, retain_graph=True, allow_unused=True)
    it = iter(got[1:] if inject is not None else got)
    for c in calls:
        c.grads = [next(it) for _ in c.outputs]
    return got[0] if inject is not None else None


def weight_grads(calls: list[Captured], leaves: dict[str, Tensor]) -> dict[str, Tensor]:
    """``W``: per captured call, the gradient of its parameters (``leaves`` by canonical name)
    from its outputs' gradients; summed per parameter. Parameters no gradient reached are left
    out."""
    out: dict[str, Tensor] = {}
    for c in calls:
        pairs = [(y, g) for y, g in zip(c.outputs, c.grads) if g is not None]
        names = [n for n in c.params.values() if n in leaves]
        if not pairs or not names:
            continue
        ys, gs = zip(*pairs)
        with torch._C.DisableTorchFunctionSubclass():
            got = torch.autograd.grad(list(ys), [leaves[n] for n in names], list(gs), retain_graph=True,
                                      allow_unused=True)
        for n, g in zip(names, got):
            if g is not None:
                out[n] = g if n not in out else out[n] + g
    return out
