"""Which ``Spec`` a state tensor has, and in which global shape: the one place save and load decide it.

``strategy_rule(strategy)`` is the default. With a ``Strategy``: under ``params/`` a tensor
follows ``strategy.param_at_rest``, under ``opt_state/`` and ``noise_history/``
(:data:`LIKE_OPT_STATE`) ``strategy.opt_state`` (the optimizer's tensors are shaped like the
parameters: ``fsdpx.optim``; a banded mechanism's past noise is drawn on the optimizer's blocks:
``privacy.mechanisms.correlated``), everything else is replicated; with
``strategy=None`` everything is replicated (an unsharded run). With a ``ShardingPlan``
(``fsdpx.sharding.plan``: per-parameter layouts, tensor parallelism included) a tensor whose
path ends in a parameter's name follows that parameter's ``at_rest`` / ``opt_state``, in the
layout's shape (``noise_history/`` as ``opt_state/``), which may be a VIEW of the parameter (q|k|v split by heads): the manifest then
records the parameter's own shape too, and a load into another view (or none) re-cuts the
whole stored tensor. ``make_rule`` lets a mapping ``{path: Spec}`` override it for some paths,
or a callable replace it.

A tensor under ``opt_state/columns/`` (:data:`COLUMNS`) holds one value per column of its
parameter (ZenFlow's per-column counts and selection masks, ``offload.checkpoint_form``): its
dims are the parameter's trailing dims (those of the layout's shape whose product matches), and
it follows those dims of the parameter's ``opt_state`` spec; without a plan it is replicated.

The GLOBAL shape is never a rule: ``save`` infers it from all ranks' local shapes
(``ckpt.boxes.global_shape``) and ``load`` reads it from the manifest (or the target view).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence, Union
from urllib.parse import unquote

from fsdpx.sharding import Spec
from fsdpx.sharding.plan import ParamLayout, ShardingPlan
from fsdpx.sharding.strategies import Strategy

LIKE_OPT_STATE = ("opt_state", "noise_history")
"""The state's top-level keys whose tensors are laid out like the optimizer state."""
COLUMNS = "opt_state/columns/"
"""The path prefix of per-column tensors (see the module doc)."""

SpecRule = Callable[[str, int], Spec]
Specs = Union[None, Mapping[str, Spec], SpecRule]
Layouts = Union[Strategy, ShardingPlan, None]


class Rule:
    """``rule(path, ndim) -> Spec``, plus the shapes a plan's views imply (see module doc)."""

    def __init__(self, spec: SpecRule, plan: ShardingPlan | None = None):
        self._spec, self.plan = spec, plan

    def __call__(self, path: str, ndim: int) -> Spec:
        return self._spec(path, ndim)

    def layout(self, path: str) -> ParamLayout | None:
        """The plan's layout of the parameter ``path`` belongs to, if any: the last part of the
        path that names a parameter (``opt_state/mu/w``; an offloading optimizer's
        ``opt_state/host/w/master``, whose tensors are blocks of ``w``'s rows; ``noise_history/0/w``)."""
        if self.plan is None:
            return None
        name = param_of(path, self.plan.params)
        return None if name is None else self.plan.params[name]

    def held(self, path: str, mesh, rank: int) -> bool:
        """Does ``rank`` hold the tensor at ``path``? Always, except under a pipeline: a
        parameter's tensors live only on the ranks of the stages that hold it."""
        lay = self.layout(path)
        pipeline = None if self.plan is None else self.plan.pipeline
        if lay is None or pipeline is None:
            return True
        name = param_of(path, self.plan.params)
        index = mesh.index(rank, pipeline.axis)
        return any(s % pipeline.degree() == index for s in pipeline.param_stages[name])

    def param_shape(self, path: str, ndim: int) -> tuple[int, ...] | None:
        """The parameter's own shape when the plan stores ``path`` (an ``ndim``-dim tensor) in a
        view of it, else None: a tensor not shaped like the layout (a per-column one, an index
        list) is not a view of the parameter."""
        lay = self.layout(path)
        if lay is None or lay.fused is None or path.startswith(COLUMNS) or ndim != len(lay.shape):
            return None
        return lay.param_shape(lay.shape)

    def target_shape(self, path: str, stored: Sequence[int], param_shape: Sequence[int] | None) -> tuple[int, ...]:
        """The global shape a load lays ``path`` out in: the plan's view when it has one for
        the path's parameter, else the parameter's own shape (``param_shape``, recorded when
        the checkpoint stored a view), else the stored shape."""
        lay = self.layout(path)
        if lay is not None and path.startswith(COLUMNS):  # the layout's column dims holding as many values
            return next((lay.shape[b:] for b in reversed(range(len(lay.shape)))
                         if math.prod(lay.shape[b:]) == math.prod(stored)), tuple(stored))
        if lay is not None and math.prod(lay.shape) == math.prod(stored):  # shaped like the parameter
            return lay.shape
        return tuple(param_shape) if param_shape is not None else tuple(stored)


def strategy_rule(strategy: Layouts) -> Rule:
    if isinstance(strategy, ShardingPlan):
        return _plan_rule(strategy)

    def rule(path: str, ndim: int) -> Spec:
        if strategy is None:
            return Spec.replicated(ndim)
        top = path.split("/", 1)[0]
        if path.startswith(COLUMNS):  # a strategy never splits a weight's columns
            return Spec.replicated(ndim)
        if top == "params":
            return strategy.param_at_rest(ndim)
        if top in LIKE_OPT_STATE:
            return strategy.opt_state(ndim)
        return Spec.replicated(ndim)

    return Rule(rule)


def _plan_rule(plan: ShardingPlan) -> Rule:
    def rule(path: str, ndim: int) -> Spec:
        lay = holder.layout(path)
        if lay is not None and path.startswith(COLUMNS) and 0 < ndim <= len(lay.shape):
            return Spec(*lay.opt_state.dims[len(lay.shape) - ndim:])
        if lay is None or len(lay.shape) != ndim:
            return Spec.replicated(ndim)  # non-parameter state, or a tensor not shaped like one
        # (a load asks for the target shape's ndim: the view's when the tensor is parameter-shaped)
        return lay.at_rest if path.startswith("params/") else lay.opt_state

    holder = Rule(rule, plan)
    return holder


def make_rule(strategy: Layouts, specs: Specs = None) -> Rule:
    """The strategy's (or plan's) rule, overridden by ``specs`` (a mapping: for the paths it
    lists; a callable: for every path)."""
    default = strategy_rule(strategy)
    if callable(specs):
        return Rule(specs, default.plan)
    if specs is None:
        return default
    table = dict(specs)
    return Rule(lambda path, ndim: table[path] if path in table else default(path, ndim), default.plan)


def layout_meta(strategy: Layouts) -> dict | None:
    """What the manifest records of a plan: its name, data and tensor-parallel axes, each
    parameter's layout (shape, view, specs) and the module styles; None for a strategy."""
    if not isinstance(strategy, ShardingPlan):
        return None
    return {
        "name": strategy.name,
        "data_axes": list(strategy.data_axes),
        "tp_axis": strategy.tp_axis,
        "params": {n: {"shape": list(lay.shape), "param_shape": list(lay.param_shape(lay.shape)),
                       "at_rest": repr(lay.at_rest), "compute": repr(lay.compute), "grad": repr(lay.grad),
                       "opt_state": repr(lay.opt_state)}
                   for n, lay in strategy.params.items()},
        "modules": {n: repr(ms.style) for n, ms in strategy.modules.items()},
        **({"pipeline": pipeline_meta(strategy.pipeline)} if strategy.pipeline is not None else {}),
    }


def pipeline_meta(layout) -> dict:
    """What the manifest records of a pipeline: its axis and degree, and for each parameter
    the pipeline indices holding it (saving reads it to know which ranks write a tensor)."""
    p = layout.degree()
    return {"axis": layout.axis, "degree": p, "schedule": layout.schedule, "microbatches": layout.microbatches,
            "stages": [list(s) for s in layout.stages],
            "holders": {n: sorted({s % p for s in held}) for n, held in layout.param_stages.items()}}


def pipeline_holders(plan_meta: dict | None, path: str) -> list[int] | None:
    """The pipeline indices holding the tensor at ``path`` (from ``layout_meta``), or None when
    every rank holds it."""
    if not plan_meta or "pipeline" not in plan_meta:
        return None
    holders = plan_meta["pipeline"]["holders"]
    name = param_of(path, holders)
    return None if name is None else holders[name]


def param_of(path: str, names: Mapping[str, object]) -> str | None:
    """The parameter a state tensor at ``path`` belongs to: the last component after ``params/``,
    ``opt_state/`` or ``noise_history/`` that is a key of ``names`` (``opt_state/mu/w``, ZenFlow's
    ``opt_state/host/w/master`` and ``noise_history/0/w`` all give ``w``), or None."""
    parts = path.split("/")
    if parts[0] not in ("params", *LIKE_OPT_STATE) or len(parts) < 2:
        return None
    return next((unquote(p) for p in reversed(parts[1:]) if unquote(p) in names), None)
