"""Units: the groups of parameters a sharded runtime gathers, frees and reduces together.

A unit is a module (e.g. one transformer block) and the trainable parameters it owns that no
deeper unit owns. The root unit (module name ``""``) holds every parameter left over
(embeddings, final norm, a tied LM head). Tied parameters must sit in one unit: a parameter
gathered by two units would be gathered and reduced twice (FSDP2 refuses it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from torch import nn


@dataclass(frozen=True)
class Unit:
    module: str  # "" for the root
    params: tuple[str, ...]  # canonical parameter names, in model order
    aliases: tuple[tuple[str, str], ...]  # (alias name, canonical name) for every use name

    def __repr__(self) -> str:
        return f"Unit({self.module or '<root>'}, {len(self.params)} params)"


def default_unit_modules(model: nn.Module) -> list[str]:
    """One unit per child of every ``nn.ModuleList`` (transformer blocks)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            out += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    return out


def make_units(model: nn.Module, trainable: Iterable[str], modules: Sequence[str] | None = None) -> list[Unit]:
    """The units of ``model`` for the ``trainable`` canonical names: the root first, then
    ``modules`` (default :func:`default_unit_modules`) in order.

    Raises ``ValueError`` naming a module that does not exist, or a tied parameter whose uses
    fall in different units."""
    modules = list(default_unit_modules(model) if modules is None else modules)
    known = dict(model.named_modules())
    for m in modules:
        if m not in known:
            raise ValueError(f"unit module {m!r} is not a submodule of the model")
    trainable = set(trainable)
    canonical = {id(p): n for n, p in model.named_parameters()}
    owner: dict[str, str] = {}
    uses: dict[str, list[tuple[str, str]]] = {m: [] for m in ["", *modules]}
    for alias, p in model.named_parameters(remove_duplicate=False):
        name = canonical[id(p)]
        if name not in trainable:
            continue
        unit = max((m for m in modules if alias.startswith(m + ".")), key=len, default="")
        if owner.setdefault(name, unit) != unit:
            raise ValueError(
                f"tied parameter {name!r} is used in unit {owner[name] or '<root>'!r} and in unit "
                f"{unit or '<root>'!r}; put both uses in one unit"
            )
        uses[unit].append((alias, name))
    order = [n for n, _ in model.named_parameters() if n in trainable]
    return [
        Unit(m, tuple(n for n in order if owner.get(n) == m), tuple(uses[m]))
        for m in ["", *modules]
    ]
