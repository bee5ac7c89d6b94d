"""The memory model of a job under a sharding strategy on ``n`` devices (no allocation).

Model state comes from the cost model (``memory_per_rank``, ``peak_gathered_bytes``) on the
job's parameter shapes, read from the model built on the meta device; activations from one
meta-device forward of one example (the bytes of every module output, what autograd keeps
alive in the worst case), times the per-rank batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from fsdpx.runtime.units import make_units
from fsdpx.sharding import strategies
from fsdpx.sharding.cost_model import memory_per_rank, peak_gathered_bytes
from fsdpx.sharding.mesh import Mesh

from .task import Task

PRIVATE_ACTIVATION_FACTOR = 2.0
"""Ghost clipping keeps each layer's input and output gradient for the per-example norms:
about twice the plain step's activations (an estimate; profiles measure the real peak)."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a job: parameter shapes, units, activation bytes per
    example (in total, and per module in ``named_modules`` order: ``module_bytes``), one
    example's input shape and dtype, and the shape of one example's hidden state entering the
    block list (``hidden``; None for a model without one)."""

    param_shapes: dict[str, tuple[int, ...]]
    units: tuple[tuple[str, ...], ...]
    activation_bytes_per_example: int
    module_bytes: tuple[tuple[str, int], ...] = ()
    example_shape: tuple[int, ...] = ()
    target_shape: tuple[int, ...] = ()
    input_dtype: torch.dtype = torch.float32
    hidden: tuple[int, ...] | None = None

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes.values())


@lru_cache(maxsize=64)
def _shape_of(task: Task) -> ModelShape:
    with torch.device("meta"):
        model = task.model_fn(task.hparams)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    units = tuple(u.params for u in make_units(model, shapes) if u.params)
    inputs, targets = task.data_fn(task.hparams)
    example = inputs[:1].to("meta")
    by_module: dict[str, int] = {name: 0 for name, _ in model.named_modules()}
    hidden: list[tuple[int, ...]] = []

    def count(name: str):
        def hook(_module, _args, out) -> None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    by_module[name] += t.numel() * t.element_size()
        return hook

    hooks = [m.register_forward_hook(count(name)) for name, m in model.named_modules()]
    blocks = _block_list(model)
    if blocks is not None and len(blocks):
        hooks.append(blocks[0].register_forward_pre_hook(
            lambda _m, args: hidden.append(tuple(args[0].shape[1:])) if args and not hidden else None))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in hooks:
            h.remove()
    return ModelShape(shapes, units, sum(by_module.values()), tuple(by_module.items()), tuple(inputs.shape[1:]),
                      tuple(targets.shape[1:]), inputs.dtype, hidden[0] if hidden else None)


def _block_list(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    from fsdpx.sharding.pipeline import PipelinePlanError, find_blocks

    try:
        return dict(model.named_modules())[find_blocks(model)]
    except PipelinePlanError:
        return None


def model_shape(task: Task) -> ModelShape:
    """The job's :class:`ModelShape` (cached per task): ``model_fn`` is called on the meta
    device and ``data_fn`` once for one example. Tasks are hashed by identity of their
    functions and equality of the rest, so equal tasks share the entry."""
    return _shape_of(task)


def contribution_bytes(task: Task, micro: int, stage_of_module: tuple[tuple[str, int], ...], stages: int,
                       local_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> tuple[int, ...]:
    """Bytes one microbatch of ``micro`` examples keeps in book-keeping contributions at each of
    ``stages`` pipeline stages, from its ``B`` to its clipped sums (its ``W``):
    ``privacy.contributions.kept_bytes`` of the contributions of the calls of the modules
    ``stage_of_module`` puts at that stage, after ``instantiate_for_reuse`` on the stage's own
    parameters, as the private pipeline's runtime keeps them (``fsdpx.runtime.pipeline``). Read
    off one forward and backward of the job's model on the ``meta`` device (shapes only; cached),
    ``method="auto"`` (a module without a ghost rule keeps per-example gradients).
    ``local_shapes``: ``(parameter, shape)`` of the blocks a tensor-parallel rank computes with
    (the largest rank's where a split is uneven): those parameters' contributions are cut to
    their block as that rank forms them (a column layer's output gradient, a row layer's input,
    a vocabulary block's rows, per-example gradients of the block).

    Guarantee: equal to what the runtime keeps, to the byte, for a GPT at tp = 1 and for the
    largest tensor-parallel rank at tp = 2 (``tests/test_contribution_bytes.py``). Edge case: a
    stage without parameters keeps 0."""
    return _contribution_bytes(task, micro, tuple(stage_of_module), stages, tuple(local_shapes))


@lru_cache(maxsize=64)
def _contribution_bytes(task: Task, micro: int, stage_of_module: tuple[tuple[str, int], ...], stages: int,
                        local_shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[int, ...]:
    with torch.device("meta"):
        model = task.model_fn(task.hparams)
    inputs, targets = task.data_fn(task.hparams)
    x = torch.empty((micro, *inputs.shape[1:]), dtype=inputs.dtype, device="meta")
    y = torch.empty((micro, *targets.shape[1:]), dtype=targets.dtype, device="meta")
    return contribution_bytes_of(model, task.loss_fn, (x, y), dict(stage_of_module), stages, dict(local_shapes))


def contribution_bytes_of(model: torch.nn.Module, loss_fn, batch: tuple, stage_of_module: dict[str, int],
                          stages: int, local_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """:func:`contribution_bytes` of ``model`` on ``batch`` (one microbatch; real or ``meta``
    tensors), its trainable parameters' calls grouped by ``stage_of_module``."""
    from fsdpx.runtime.step_memory import LiveBytes
    from privacy import contributions as C
    from privacy.ghost import contributions
    from privacy.tape import Tape, record

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    local = {n: tuple(shape) for n, shape in (local_shapes or {}).items()
             if n in params and tuple(shape) != tuple(params[n].shape)}
    out = []
    with LiveBytes():  # answers the data-dependent calls a meta run meets
        tape = record(model, params, batch, loss_fn)
        for s in range(stages):
            calls = [c for c in tape.calls if stage_of_module.get(c.module_name) == s]
            parts = contributions(model, params, Tape(calls, None), method="auto")
            parts = _cut_to_blocks(parts, {n: tuple(params[n].shape) for n in parts}, local)
            parts = C.instantiate_for_reuse(parts, {n: torch.Size(local.get(n, params[n].shape)) for n in parts})
            out.append(C.kept_bytes(parts))
    return tuple(out)


def _cut_to_blocks(parts: dict, shapes: dict[str, tuple[int, ...]], local: dict[str, tuple[int, ...]]) -> dict:
    """``parts`` as a rank holding the blocks ``local`` of some parameters forms them: a factored
    contribution of a parameter viewed as ``[rows, n]`` has its dense left factor cut to the
    block's rows (one-hot ids stay) and its right factor to the block's ``n``; a dense one is the
    block's per-example gradients. The factors are new ``meta`` tensors, one per factor and
    shape: a factor two such contributions share (the input of q, k and v) is still
    counted once, but never shared with a whole layer's contribution (on the rank a split
    layer's output passes a collective, so its gradient is a tensor of its own)."""
    from privacy.contributions import Dense, Factored

    made: dict = {}  # (id of a factor, its cut size) -> (the factor, kept alive; its cut)

    def cut(t: torch.Tensor, last: int) -> torch.Tensor:
        key = (id(t), last)
        if key not in made:
            made[key] = (t, torch.empty((*t.shape[:-1], last), dtype=t.dtype, device="meta"))
        return made[key][1]

    out = {}
    for name, plist in parts.items():
        if name not in local:
            out[name] = plist
            continue
        full, block = shapes[name], local[name]
        rows, n = block[0], math.prod(block[1:])
        cut_parts = []
        for p in plist:
            if isinstance(p, Dense):
                cut_parts.append(Dense(torch.empty((p.grads.shape[0], *block), dtype=p.grads.dtype, device="meta")))
            elif p.rows == (0, full[0]):
                left = p.left if p.one_hot else cut(p.left, rows)
                cut_parts.append(Factored(left, cut(p.right, n), rows, (0, rows)))
            else:  # a block of rows (grouped convolutions): kept whole, an upper bound
                cut_parts.append(p)
        out[name] = cut_parts
    return out


def job_memory(task: Task, strategy: str, n: int, *, optimizer_fraction: float = 1.0) -> int:
    """Estimated peak bytes on the worst of ``n`` ranks: parameters, gradients and
    ``optimizer_fraction`` of AdamW's two state tensors at rest (``memory_per_rank``; ZenFlow
    keeps only its selected columns' state on the device), the largest gathered unit
    (``peak_gathered_bytes``), and activations of ``ceil(batch_size / n)`` examples
    (``PRIVATE_ACTIVATION_FACTOR`` times more for a private job).

    Guarantee: non-increasing in ``n`` for zero2 and zero3 at fixed batch (more ranks, smaller
    shards and batch shares) (``tests/test_jobs_registry.py::test_memory_model_shrinks_with_devices``).
    """
    if not 0 <= optimizer_fraction <= 1:
        raise ValueError(f"optimizer_fraction must be in [0, 1], got {optimizer_fraction}")
    shape = model_shape(task)
    plan = strategies.ALL[strategy](axis="dp")
    mesh = Mesh(dp=n)
    without = memory_per_rank(plan, shape.param_shapes, mesh, optimizer="sgd")
    with_state = memory_per_rank(plan, shape.param_shapes, mesh, optimizer="adamw")
    state = without + round(optimizer_fraction * (with_state - without))
    gathered = peak_gathered_bytes(plan, shape.param_shapes, mesh, [list(u) for u in shape.units])
    factor = PRIVATE_ACTIVATION_FACTOR if task.private else 1.0
    activations = round(factor * shape.activation_bytes_per_example * math.ceil(task.batch_size / n))
    return state + gathered + activations
