"""The activation collectives of a tensor-parallel step, derived by running it on meta tensors.

Parameter collectives follow from layouts alone (``fsdpx.sharding.cost_model``). Activation
collectives depend on what the model does with its activations, so they are read off the model
itself: rank 0's forward and backward run on ``meta`` tensors (shapes only, no data, no time)
with the same ``TensorParallelHooks`` the runtime installs, and a communicator that records each
``Collective`` instead of running it. What is counted is therefore exactly what the runtime
would run, for any model and plan; ``comm_per_step(..., activations=...)`` adds their bytes.

For the GPT plan on ``tp`` ranks, batch share ``B`` (rank 0's), sequence ``T``, width ``C``,
vocabulary ``V``, ``s`` bytes per element (buffer bytes, the ``fsdpx.sharding.collectives``
convention), this gives per block 2 all-reduces of ``B T C s`` forward (attention and MLP
outputs, ``g``) and 2 backward (their inputs, ``f``); per step one more each way for the
embedding output (forward) and the LM head's input (backward); the loss's all-gather of
``2 B T`` values per rank (buffer ``tp 2 B T s``); private steps one all-reduce of ``B`` squared
norms (``tests/test_tensor_parallel.py::test_activation_bytes_follow_the_megatron_formula``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fsdpx.sharding.collectives import Collective
from fsdpx.sharding.layout import chunk_bounds, local_shape
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.pipeline import microbatch_bounds
from fsdpx.sharding.plan import ShardingPlan
from privacy.tape import record

from .sharded_clipping import sharded_norms
from .stages import StageExit, StageForward, absent_uses
from .tensor_parallel import TensorParallelHooks


class _RecordingComm:
    """Rank 0 of ``mesh``: records every collective and answers with a meta tensor of rank
    0's output shape."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.rank = mesh, 0
        self.recorded: list[Collective] = []

    def run(self, c: Collective, local: Tensor) -> Tensor:
        self.recorded.append(c)
        return torch.empty(local_shape(c.shape, c.dst, c.mesh, 0), dtype=local.dtype, device="meta")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.mesh.size

    def counts(self) -> dict[str, int]:
        return {}

    def reset_counts(self) -> None:
        pass


def activation_collectives(model: nn.Module, plan: ShardingPlan, mesh: Mesh, loss_fn: Callable,
                           inputs: Sequence[int], targets: Sequence[int], *, dtype: torch.dtype = torch.float32,
                           private: bool = False, input_dtype: torch.dtype = torch.long) -> list[Collective]:
    """Every activation collective rank 0 runs in one step on a global batch of ``inputs``
    (shape, e.g. ``(B, T)`` token ids) and ``targets`` (shape), in execution order.

    Returns ``[]`` without tensor parallelism. Rank 0's batch share is ``torch.chunk`` piece 0
    over the plan's data axes, as the runtime cuts it; ``private`` adds the all-reduce of the
    squared norms (and, with sequence parallelism, of the per-example gradients of the parameters
    every rank sees a chunk of the sequence for: all of them are assumed to take part in the
    forward, as in every model here). Guarantee: the runtime's counted activation bytes on rank 0
    equal ``cost`` of this list (``property_tests/test_tensor_parallel_properties.py::
    test_counted_bytes_and_resident_memory_equal_the_cost_model``).

    Edge cases: an empty share (a batch smaller than the data axes) still has rank 0 first, so
    rank 0's share is empty only for an empty batch, which runs no activation collective."""
    if not plan.modules or plan.tp_axis is None:
        return []
    comm = _RecordingComm(mesh)
    b0 = chunk_bounds(inputs[0], mesh.axis_size(plan.data_axes), 0)[1]
    if b0 == 0:
        return []
    params = {}
    for name, lay in plan.params.items():
        shape = lay.param_shape(local_shape(lay.shape, lay.compute, mesh, 0))
        params[name] = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
    x = torch.zeros((b0, *inputs[1:]), dtype=input_dtype, device="meta")
    y = torch.zeros((b0, *targets[1:]), dtype=torch.long, device="meta")
    seq_len = inputs[plan.sequence_dim] if plan.sequence_dim is not None else 0
    with TensorParallelHooks(model, plan, comm).installed(seq_len):
        if private:  # the private backward asks for the layers' output gradients, not the weights'
            record(model, params, (x, y), loss_fn)
        else:
            losses = loss_fn(functional_call(model, params, (x,)), y)
            torch.autograd.grad(losses.sum(), list(params.values()), allow_unused=True)
    if private:
        norms = sharded_norms(plan, comm)
        if norms is not None:
            summed = sum(plan.numel(n) for n in norms.partial)  # sequence parallelism's chunked gradients
            if summed:
                norms.all_reduce(torch.empty(b0, summed, dtype=dtype, device="meta"))
            norms.all_reduce(torch.empty(b0, dtype=dtype, device="meta"))
    return comm.recorded


def pipeline_activation_collectives(model: nn.Module, plan: ShardingPlan, mesh: Mesh, loss_fn: Callable,
                                    inputs: Sequence[int], targets: Sequence[int], hidden: Sequence[int], *,
                                    dtype: torch.dtype = torch.float32,
                                    input_dtype: torch.dtype = torch.long) -> list[Collective]:
    """Every tensor-parallel activation collective rank 0 runs in one pipelined step of a global
    batch of ``inputs`` / ``targets`` (shapes): each stage of rank 0's pipeline index, for each
    of its non-empty microbatches (``microbatch_bounds`` of rank 0's data-parallel share), traced
    on meta tensors as the runtime runs it (``fsdpx.runtime.stages``: the stage's blocks only,
    the received ``hidden`` activation injected, stopped after its last block; the loss on the
    last stage; then the backward to the stage input and its parameters). Collectives run on the
    stage group, the mesh without the pipeline axis. A private step runs the same activation
    collectives (its backward reaches the same layer outputs); its norms' all-reduce is
    ``pipeline_comm_per_step(..., private=True)``'s.

    Returns ``[]`` without tensor parallelism. Guarantee: with ``pipeline_comm_per_step(...,
    activations=...)`` rank 0's counted bytes (``property_tests/test_pipeline_properties.py::
    test_counted_bytes_equal_pipeline_comm_per_step``)."""
    layout = plan.pipeline
    if not plan.modules or plan.tp_axis is None or layout is None:
        return []
    sub = mesh.sub(tuple(a for a in mesh.axis_names if a != layout.axis))
    comm = _RecordingComm(sub)
    share = chunk_bounds(inputs[0], mesh.axis_size(plan.data_axes), 0)[1]
    sizes = [b - a for a, b in microbatch_bounds(share, layout.microbatches) if b > a]
    last = layout.num_stages - 1
    for s in layout.stages_on(0):
        names = layout.params_of([s])
        forward = StageForward(model, layout, absent_uses(model, plan.params, layout, s), device="meta")
        for size in sizes:
            params = {}
            for n in names:
                lay = plan.params[n]
                shape = lay.param_shape(local_shape(lay.shape, lay.compute, sub, 0))
                params[n] = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
            x = torch.zeros((size, *inputs[1:]), dtype=input_dtype, device="meta")
            inject = torch.empty((size, *hidden), dtype=dtype, device="meta", requires_grad=True) if s else None
            with TensorParallelHooks(model, plan, comm).installed(0), forward.running(s, inject):
                try:
                    out = functional_call(model, params, (x,))
                except StageExit as e:
                    out = e.output
                if s == last:
                    y = torch.zeros((size, *targets[1:]), dtype=torch.long, device="meta")
                    root, seed = loss_fn(out, y).sum(), None
                else:
                    root, seed = out, torch.empty_like(out)
                leaves = ([inject] if inject is not None else []) + list(params.values())
                torch.autograd.grad(root, leaves, seed, allow_unused=True)
    return comm.recorded
