"""Scratch buffers that a step function keeps from one step to the next.

Ghost clipping forms large per-example gradient blocks (``[B, *param.shape]``) every step, with
the same shapes each time. Freshly allocated, each 4 KiB page of them is faulted in by the
kernel on first touch (about 1 microsecond per page on these machines): on the benchmark GPT
that is tens of thousands of faults per step, several percent of the step. A :class:`Workspace`
hands out the same tensors every step instead, so their pages are faulted once per run.

Ownership is explicit, as with JAX's donated buffers: a step function built by
:func:`privacy.step.make_private_step` or :func:`fsdpx.runtime.make_sharded_step` owns one
workspace and passes it down; pure callers pass none and get fresh tensors. Nothing a workspace
hands out is ever returned to the caller of a step, so reusing it cannot change a result
(``tests/test_private_step.py::test_a_step_with_a_workspace_gives_the_same_bits``). A workspace
is not thread-safe: do not run one step function from two threads at once.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Workspace:
    """Named scratch tensors, reallocated only when a name is asked for with another shape,
    dtype or device."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...] | torch.Size, like: Tensor) -> Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device; the same
        tensor as the last call with this ``name`` when shape, dtype and device match."""
        shape = torch.Size(shape)
        held = self._buffers.get(name)
        if held is None or held.shape != shape or held.dtype != like.dtype or held.device != like.device:
            held = like.new_empty(shape)
            self._buffers[name] = held
        return held

    def nbytes(self) -> int:
        """Bytes held between steps."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer (the memory is returned once no tensor refers to it)."""
        self._buffers.clear()


def scratch(workspace: Workspace | None, name: str, shape: tuple[int, ...] | torch.Size, like: Tensor) -> Tensor:
    """``workspace.buffer(name, shape, like)``, or a fresh uninitialised tensor without one."""
    return like.new_empty(shape) if workspace is None else workspace.buffer(name, shape, like)
