"""Executing a tensor-parallel plan on an unmodified model: module hooks for one step.

``fsdpx.sharding.tensor_parallel.resolve`` decided each parameter's compute layout; the
``Gatherer`` swaps this rank's blocks into the modules. What is left is the activations, done
here with forward hooks on the styled modules, installed only inside :meth:`TensorParallelHooks.installed`:

* ``ColumnParallel``: the input enters the region (``regions.enter``) unless an enclosing
  ``EnterParallel`` did; with ``vocab=True`` the output logits are marked vocabulary-sharded
  (``vocab_parallel``). transformers' ``Conv1D`` reshapes its output with its ``nf`` (the full
  width), which is set to the rank's width for the call.
* ``RowParallel``: the bias is swapped for zeros during the call (the local product is one
  summand of the output); after it the output leaves the region (``regions.leave``: summed
  over ``tp``) and the bias is added once.
* ``VocabParallelEmbedding``: ids outside the rank's rows become row 0 of its slice, and their
  output rows are zeroed; the output leaves the region. ``padding_idx`` is made local.
* ``EnterParallel``: the named input enters the region.
* ``LocalAttributes``: the attributes are divided by ``tp`` during the call.
* ``SequenceParallel``: the first input (the whole sequence) is cut to the rank's chunk.

With sequence parallelism every ``enter`` all-gathers along the sequence and every ``leave``
reduce-scatters along it (``regions``).

A module keeps its own forward; only its inputs, parameters and attributes change for the call,
so Hugging Face models run as they are. The private tape (``privacy.tape``) records each call's
raw output (its hook runs first), whose gradient is the layer's own: the row-parallel partial
sum's gradient is the whole output gradient, the embedding's is zero on masked rows.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils._named_member_accessor import swap_tensor

from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import chunk_bounds
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.tensor_parallel import (
    ColumnParallel,
    EnterParallel,
    LocalAttributes,
    ModuleStyle,
    ReplicatedOnSplit,
    RowParallel,
    SequenceParallel,
    VocabParallelEmbedding,
    is_conv1d,
)

from .regions import enter, leave, sequence_chunk
from .vocab_parallel import VocabShard, mark_vocab_sharded


class TensorParallelHooks:
    """The activation side of a plan's module styles, for one rank."""

    def __init__(self, model: nn.Module, plan: ShardingPlan, comm: Comm):
        self.model, self.plan, self.comm = model, plan, comm
        self.axis = plan.tp_axis
        self.tp = comm.mesh.axis_size(self.axis) if self.axis else 1
        self.index = comm.mesh.index(comm.rank, self.axis) if self.axis else 0
        self.seq_dim = plan.sequence_dim  # sequence parallelism, or None
        self.seq_len = 0  # the step's sequence length (sequence parallelism), set by ``installed``

    def rows(self, style: ModuleStyle) -> tuple[int, int]:
        """``[start, stop)`` of the style's split features held by this rank."""
        return chunk_bounds(style.size, self.tp, self.index)

    @contextlib.contextmanager
    def installed(self, seq_len: int = 0) -> Iterator[None]:
        """Hooks on every styled module while the block runs; attributes and parameters are
        restored on exit, also when the forward raises. ``seq_len``: the step's sequence length
        (needed with sequence parallelism, where a rank holds a chunk of it)."""
        self.seq_len = seq_len
        if not self.plan.modules:
            yield
            return
        modules = dict(self.model.named_modules())
        handles, restore = [], []
        try:
            for name, ms in self.plan.modules.items():
                pre, post = self._hooks(ms, restore)
                if pre is not None:
                    handles.append(modules[name].register_forward_pre_hook(pre, with_kwargs=True))
                if post is not None:
                    handles.append(modules[name].register_forward_hook(post, with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()
            for undo in reversed(restore):
                undo()

    def _hooks(self, ms: ModuleStyle, restore: list):
        style = ms.style
        if isinstance(style, ColumnParallel):
            return self._column(ms, style, restore)
        if isinstance(style, RowParallel):
            return self._row(restore)
        if isinstance(style, VocabParallelEmbedding):
            return self._embedding(ms, restore)
        if isinstance(style, EnterParallel):
            return self._enter_at(style.arg), None
        if isinstance(style, LocalAttributes):
            return self._attributes(style, restore)
        if isinstance(style, SequenceParallel):
            return self._sequence_chunk, None
        if isinstance(style, ReplicatedOnSplit):
            return None, None  # runs as written; its gradient's sum over tp is the plan's (raw_grad partial)
        raise TypeError(f"unknown tensor-parallel style {style!r}")

    def _enter(self, x: Tensor) -> Tensor:
        return enter(x, self.comm, self.axis, seq_dim=self.seq_dim, seq_len=self.seq_len)

    def _leave(self, x: Tensor) -> Tensor:
        return leave(x, self.comm, self.axis, seq_dim=self.seq_dim)

    def _sequence_chunk(self, module: nn.Module, args: tuple, kwargs: dict):
        return (sequence_chunk(args[0], self.comm, self.axis, self.seq_dim), *args[1:]), kwargs

    # ---- styles ------------------------------------------------------------------------------

    def _column(self, ms: ModuleStyle, style: ColumnParallel, restore: list):
        entry = self._enter_at(0) if style.enter else None
        widths: list[tuple[nn.Module, int]] = []  # transformers' Conv1D: (module, its full ``nf``)
        restore.append(lambda: [setattr(m, "nf", nf) for m, nf in reversed(widths)])
        shard = None
        if style.vocab:
            start, stop = self.rows(ms)
            shard = VocabShard(self.comm, self.axis, start, stop, ms.size)

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if is_conv1d(module):  # its forward views the output as ``(..., nf)``: the rank's width
                widths.append((module, module.nf))
                module.nf = module.weight.shape[-1]
            return entry(module, args, kwargs) if entry is not None else None

        def post(module: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor | None:
            if widths and widths[-1][0] is module:
                module.nf = widths.pop()[1]
            return mark_vocab_sharded(out, shard) if shard is not None else None

        return pre, post

    def _row(self, restore: list):
        held: list[tuple[nn.Module, Tensor]] = []  # (module, its bias) while a call runs
        restore.append(lambda: [swap_tensor(m, "bias", b) for m, b in reversed(held)])

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            bias = getattr(module, "bias", None)
            if bias is not None:
                held.append((module, swap_tensor(module, "bias", torch.zeros_like(bias))))

        def post(module: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
            out = self._leave(out)
            if held and held[-1][0] is module:
                _, bias = held.pop()
                swap_tensor(module, "bias", bias)
                # with sequence parallelism each rank adds it to its chunk: entering the bias
                # all-reduces its gradient, so it is whole (replicated) as without, and as the
                # private tape computes it from the layer's whole output gradient
                out = out + (bias if self.seq_dim is None else enter(bias, self.comm, self.axis))
            return out

        return pre, post

    def _embedding(self, ms: ModuleStyle, restore: list):
        start, stop = self.rows(ms)
        calls: list[tuple[nn.Module, Tensor, int | None]] = []  # (module, mask, its padding_idx)
        restore.append(lambda: [setattr(m, "padding_idx", pad) for m, _, pad in reversed(calls)])

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            ids = args[0]
            inside = (ids >= start) & (ids < stop)
            pad = module.padding_idx
            calls.append((module, inside, pad))
            if pad is not None:
                module.padding_idx = pad - start if start <= pad < stop else None
            local = torch.where(inside, ids - start, torch.zeros_like(ids))
            return (local, *args[1:]), kwargs

        def post(module: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
            _, inside, pad = calls.pop()
            module.padding_idx = pad
            out = torch.where(inside.unsqueeze(-1), out, torch.zeros_like(out))
            return self._leave(out)

        return pre, post

    def _enter_at(self, arg: int | str):
        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if isinstance(arg, str) and arg in kwargs:
                return args, {**kwargs, arg: self._enter(kwargs[arg])}
            if isinstance(arg, int) and arg < len(args):
                args = list(args)
                args[arg] = self._enter(args[arg])
                return tuple(args), kwargs
            raise TypeError(f"{type(module).__name__} was called without its input {arg!r}, which the"
                            " tensor-parallel plan enters the region at")
        return pre

    def _attributes(self, style: LocalAttributes, restore: list):
        saved: list[tuple[nn.Module, dict[str, int]]] = []
        restore.append(lambda: [setattr(m, n, v) for m, vs in reversed(saved) for n, v in vs.items()])

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            values = {n: getattr(module, n) for n in style.names}
            saved.append((module, values))
            for n, v in values.items():
                setattr(module, n, v // self.tp)

        def post(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            _, values = saved.pop()
            for n, v in values.items():
                setattr(module, n, v)

        return pre, post
