"""Which ``Spec`` a state tensor has, from its path: the one place save and load decide it.

``strategy_rule(strategy)`` is the default: under ``params/`` a tensor follows
``strategy.param_at_rest``, under ``opt_state/`` ``strategy.opt_state`` (the optimizer's
tensors are shaped like the parameters: ``fsdpx.optim``), everything else is replicated; with
``strategy=None`` everything is replicated (an unsharded run). ``make_rule`` lets a mapping
``{path: Spec}`` override it for some paths, or a callable replace it.

The GLOBAL shape is never a rule: ``save`` infers it from all ranks' local shapes
(``ckpt.boxes.global_shape``) and ``load`` reads it from the manifest.
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

from fsdpx.sharding import Spec
from fsdpx.sharding.strategies import Strategy

SpecRule = Callable[[str, int], Spec]
Specs = Union[None, Mapping[str, Spec], SpecRule]


def strategy_rule(strategy: Strategy | None) -> SpecRule:
    def rule(path: str, ndim: int) -> Spec:
        if strategy is None:
            return Spec.replicated(ndim)
        top = path.split("/", 1)[0]
        if top == "params":
            return strategy.param_at_rest(ndim)
        if top == "opt_state":
            return strategy.opt_state(ndim)
        return Spec.replicated(ndim)

    return rule


def make_rule(strategy: Strategy | None, specs: Specs = None) -> SpecRule:
    """The strategy's rule, overridden by ``specs`` (a mapping: for the paths it lists; a
    callable: for every path)."""
    if callable(specs):
        return specs
    default = strategy_rule(strategy)
    if specs is None:
        return default
    table = dict(specs)
    return lambda path, ndim: table[path] if path in table else default(path, ndim)
