"""A sharding plan as data: one resolved layout per parameter, plus the step-wide flags.

A ``ParamLayout`` says where one parameter lives in each phase of a train step (at rest, in
compute, its raw and reduced gradient, its optimizer state), as ``Spec``s of one global
``shape``. A ``ShardingPlan`` is the table of them and the two flags the runtime needs besides
(the data axes, and whether gathered parameters are freed after the forward).

Strategies build plans (``Strategy.resolve``: every parameter gets the strategy's rules applied
to its dim count) and tensor parallelism builds them too
(``fsdpx.sharding.tensor_parallel.resolve``: per-module styles give each parameter a compute
layout over ``tp``, and the data-parallel strategy shards the rest). The runtime and the cost
model read only the plan, so a layout change never needs a code change.

``shape`` is the parameter's shape, or a VIEW of it that splits one dim into ``(groups, n /
groups)`` (``fused``): GPT-2's ``c_attn`` holds q, k and v side by side, and tensor
parallelism splits each of them by heads, which is a box of the view ``[in, 3, C]`` but not of
``[in, 3C]``. Viewing a contiguous tensor keeps its row-major flat order, so flat indices (and
the noise drawn by index) are the same in both shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .spec import Spec


@dataclass(frozen=True)
class Transition:
    """One change of layout in a train step: ``phase`` names when, for one tensor."""

    phase: str
    src: Spec
    dst: Spec


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives, as specs of the global ``shape``.

    * ``at_rest``: between steps (what memory holds).
    * ``compute``: during forward/backward (gathered transiently if different).
    * ``raw_grad``: the gradient the backward produces, before any reduction: ``compute`` made
      partial over the data axes (each rank saw other examples), and over ``tp`` where the
      parameter is replicated but its uses diverge (sequence-parallel norms).
    * ``grad``: the reduced gradient; ``opt_state``: every optimizer-state tensor (the update
      runs in this layout).
    * ``fused``: ``(dim, groups)`` when ``shape`` views the parameter's dim ``dim`` as
      ``(groups, n / groups)``, else ``None``.

    Guarantee: every spec has ``len(shape)`` dims (checked at construction, ``ValueError``)."""

    shape: tuple[int, ...]
    at_rest: Spec
    compute: Spec
    raw_grad: Spec
    grad: Spec
    opt_state: Spec
    fused: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        for name in ("at_rest", "compute", "raw_grad", "grad", "opt_state"):
            spec = getattr(self, name)
            if spec.ndim != len(self.shape):
                raise ValueError(f"{name} {spec} has {spec.ndim} dims but the layout's shape {self.shape} has"
                                 f" {len(self.shape)}")

    def param_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """A tensor of this layout's (local or global) view shape, as the parameter's shape:
        the fused pair of dims merged back (identity without ``fused``)."""
        shape = tuple(shape)
        if self.fused is None:
            return shape
        d = self.fused[0]
        return shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:]

    # ---- transitions: what a runtime runs, per parameter, and the cost model costs ----------

    def forward_transitions(self) -> list[Transition]:
        """Before the unit's forward (and again before its backward if the plan reshards)."""
        t = Transition("gather_for_forward", self.at_rest, self.compute)
        return [t] if t.src != t.dst else []

    def backward_transitions(self, reshard_after_forward: bool) -> list[Transition]:
        """During the unit's backward: re-gather (if resharded) and reduce."""
        out = []
        if reshard_after_forward:
            out += [Transition("gather_for_backward", t.src, t.dst) for t in self.forward_transitions()]
        out.append(Transition("reduce_grad", self.raw_grad, self.grad))
        return out

    def update_transitions(self) -> list[Transition]:
        """Around the optimizer step: grad and param to the optimizer state's layout, step
        there, then the param back to its at-rest layout."""
        steps = [
            Transition("grad_to_update", self.grad, self.opt_state),
            Transition("param_to_update", self.at_rest, self.opt_state),
            Transition("param_from_update", self.opt_state, self.at_rest),
        ]
        return [t for t in steps if t.src != t.dst]


def fused_view(shape: Sequence[int], fused: tuple[int, int] | None) -> tuple[int, ...]:
    """``shape`` with dim ``fused[0]`` split into ``(groups, n / groups)``; ``ValueError`` if
    the groups do not divide it."""
    shape = tuple(shape)
    if fused is None:
        return shape
    d, groups = fused
    if shape[d] % groups:
        raise ValueError(f"dim {d} of shape {shape} does not split into {groups} equal blocks")
    return shape[:d] + (groups, shape[d] // groups) + shape[d + 1:]


@dataclass(frozen=True)
class ShardingPlan:
    """Every parameter's ``ParamLayout`` and the step-wide flags.

    * ``params``: ``{canonical parameter name: ParamLayout}``.
    * ``data_axes``: the mesh axes the batch is split over (tensor-parallel ranks share a
      batch, so ``tp`` is never one).
    * ``reshard_after_forward``: free gathered parameters after a unit's forward and gather
      again for its backward (ZeRO-3 / FSDP FULL_SHARD).
    * ``name``: for messages and the run's config digest.
    * ``modules``: the tensor-parallel styles by module name (empty without tensor
      parallelism), and ``tp_axis``, the mesh axis they split over; ``sequence_dim``: with
      sequence parallelism, the activation dim split over ``tp`` outside the regions.
    * ``pipeline``: with pipeline parallelism, the ``fsdpx.sharding.pipeline.PipelineLayout``
      (stages, the parameters each holds, schedule); a rank holds only its stages' parameters
      (``fsdpx.sharding.pipeline.rank_plan``), each in the layout given here.
    """

    params: Mapping[str, ParamLayout]
    data_axes: tuple[str, ...]
    reshard_after_forward: bool
    name: str
    modules: Mapping[str, object] = field(default_factory=dict)
    tp_axis: str | None = None
    sequence_dim: int | None = None  # sequence parallelism: activations between regions split on this dim
    pipeline: object | None = None  # fsdpx.sharding.pipeline.PipelineLayout: stages over a pipeline axis

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The global shape every spec of each parameter applies to (its view)."""
        return {n: lay.shape for n, lay in self.params.items()}

    def numel(self, name: str) -> int:
        return math.prod(self.params[name].shape)

    def describe(self) -> str:
        """One line per parameter: name, shape, and the specs that differ from replicated."""
        lines = [f"plan {self.name}: data axes {self.data_axes}, reshard after forward {self.reshard_after_forward}"]
        for n, lay in self.params.items():
            lines.append(f"  {n} {list(lay.shape)}: rest {lay.at_rest}, compute {lay.compute}, grad {lay.grad},"
                         f" opt {lay.opt_state}")
        return "\n".join(lines)
