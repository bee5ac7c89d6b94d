"""Freezing and unfreezing parameters during a run: the schedule as data, and the optimizer
update that leaves frozen parameters and their state untouched.

A schedule says which parameters train at each step::

    Freezing({0: {"wte", "wpe"}, 100: set()})    # embeddings frozen for steps 0-99, then trained
    Freezing.parse("wte,wpe@0-100")              # the same, as a config string
    lambda step: {"lm_head"} if step < 10 else {"lm_head", "h.0"}   # a callable: TRAINABLE names

Names are canonical parameter names, any alias of a tied parameter (``lm_head.weight`` for
GPT-2's ``transformer.wte.weight``: one tensor, so freezing either freezes both uses), or module
names (``"wte"`` covers ``wte.weight``). A schedule is a pure function of the step, so every rank
of a sharded run computes the same set with no communication, and it changes only between steps.

The steps take it as ``trainable=`` (``privacy.step.make_private_step``,
``fsdpx.runtime.plain_step.make_plain_step``, ``fsdpx.runtime.make_sharded_step``) and update
through :func:`frozen_update`: :func:`update_trainable` around an elementwise optimizer, the
optimizer's own ``update`` for one that freezes by itself (``Optimizer.partial_grads``: ZenFlow,
ZeRO-Offload).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence, Union

from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from .optimizers import Optimizer, OptState, Params

UpdateFn = Callable[[Params, OptState, Params], tuple[Params, OptState]]


@dataclass(frozen=True)
class Freezing:
    """Which parameters are FROZEN from which step on: ``Freezing({step: names, ...})``.

    The set given for step ``s`` holds from ``s`` until the next key; before the first key
    nothing is frozen. Immutable and hashable (it is part of a run's configuration).
    ``tests/test_freezing.py::test_freezing_schedule_holds_each_set_until_the_next_key``."""

    changes: tuple[tuple[int, frozenset[str]], ...]

    def __init__(self, frozen: Mapping[int, Iterable[str]] | None = None):
        items = []
        for step, names in sorted((frozen or {}).items()):
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"Freezing: steps must be ints >= 0, got {step!r}")
            if isinstance(names, str):
                raise TypeError(f"Freezing: step {step} maps to the string {names!r}; give a set of names")
            items.append((step, frozenset(names)))
        object.__setattr__(self, "changes", tuple(items))

    def frozen_at(self, step: int) -> frozenset[str]:
        """The names (as given) frozen at ``step``."""
        out: frozenset[str] = frozenset()
        for start, names in self.changes:
            if start > step:
                break
            out = names
        return out

    def names(self) -> frozenset[str]:
        """Every name the schedule mentions."""
        return frozenset(n for _, names in self.changes for n in names)

    @classmethod
    def parse(cls, text: str) -> "Freezing":
        """``"a,b@0-100;c@50-"``: groups separated by ``;``, each ``names@start-stop`` (frozen for
        steps ``start <= t < stop``; an empty stop is open-ended, an empty start is 0) or bare
        ``names`` (frozen for the whole run). Raises ``ValueError`` naming a malformed group.
        ``tests/test_freezing.py::test_parse_reads_intervals``."""
        groups: list[tuple[frozenset[str], int, int | None]] = []
        for raw in text.split(";"):
            part = raw.strip()
            if not part:
                continue
            names_text, _, span = part.partition("@")
            names = frozenset(n.strip() for n in names_text.split(",") if n.strip())
            if not names:
                raise ValueError(f"freeze group {part!r} names no parameter")
            start, stop = 0, None
            if span:
                lo, dash, hi = span.partition("-")
                try:
                    start = int(lo) if lo.strip() else 0
                    stop = int(hi) if hi.strip() else None
                except ValueError:
                    raise ValueError(f"freeze group {part!r}: the steps must read 'start-stop' (ints)") from None
                if not dash or start < 0 or (stop is not None and stop <= start):
                    raise ValueError(f"freeze group {part!r}: need 0 <= start < stop in 'names@start-stop'")
            groups.append((names, start, stop))
        bounds = sorted({0} | {g[1] for g in groups} | {g[2] for g in groups if g[2] is not None})
        frozen: dict[int, frozenset[str]] = {}
        last: frozenset[str] = frozenset()
        for b in bounds:
            here = frozenset().union(*[n for n, lo, hi in groups if lo <= b and (hi is None or b < hi)])
            if here != last or not frozen:
                frozen[b] = here
            last = here
        return cls(frozen)


Trainable = Union[Freezing, Callable[[int], Iterable[str]]]
"""A ``Freezing`` (the FROZEN names per step) or a callable ``step -> TRAINABLE names``."""


class TrainableSets:
    """A schedule bound to a model's parameters: ``sets(step)`` is the frozenset of canonical
    names that train at ``step``.

    ``names``: the canonical names the step holds (what can train); ``aliases``: every other
    name a parameter is known by -> its canonical name (tied weights). A ``Freezing``'s names are
    checked here, before any step; a callable's at each step. A name matching nothing raises
    ``KeyError`` naming it. ``tests/test_freezing.py::test_names_resolve_to_canonical_parameters``."""

    def __init__(self, schedule: Trainable, names: Sequence[str], aliases: Mapping[str, str] | None = None):
        if not isinstance(schedule, Freezing) and not callable(schedule):
            raise TypeError(f"trainable must be a Freezing or a callable step -> names, got {type(schedule).__name__}")
        self.schedule = schedule
        self.names = tuple(names)
        held = set(self.names)
        self.aliases = {**{n: n for n in self.names}, **{a: c for a, c in (aliases or {}).items() if c in held}}
        self._cache: dict[frozenset[str], frozenset[str]] = {}
        if isinstance(schedule, Freezing):
            self.resolve(schedule.names())

    def resolve(self, patterns: Iterable[str]) -> frozenset[str]:
        """The canonical names ``patterns`` cover (a name, an alias, or a module prefix)."""
        patterns = frozenset(patterns)
        if patterns not in self._cache:
            out, unknown = set(), []
            for p in sorted(patterns):
                hit = {c for a, c in self.aliases.items() if a == p or a.startswith(p + ".")}
                if not hit:
                    unknown.append(p)
                out |= hit
            if unknown:
                raise KeyError(f"freezing names {unknown} match no trainable parameter "
                               f"(known: {', '.join(self.names[:8])}{' ...' if len(self.names) > 8 else ''})")
            self._cache[patterns] = frozenset(out)
        return self._cache[patterns]

    def __call__(self, step: int) -> frozenset[str]:
        """The canonical names that train at ``step``; ``ValueError`` if none does (a step
        that trains nothing is a mistake in the schedule, not a step)."""
        if isinstance(self.schedule, Freezing):
            out = frozenset(self.names) - self.resolve(self.schedule.frozen_at(step))
        else:
            got = self.schedule(step)
            if isinstance(got, str):
                raise TypeError(f"trainable({step}) returned the string {got!r}; return a set of names")
            out = self.resolve(got)
        if not out:
            raise ValueError(f"the freezing schedule leaves nothing to train at step {step}")
        return out

    def split(self, params: Params, step: int) -> tuple[Params, Params]:
        """``(trainable, frozen)``: ``params`` cut by the set of ``step``, each in ``params``'
        order."""
        names = self(step)
        return ({k: v for k, v in params.items() if k in names}, {k: v for k, v in params.items() if k not in names})


def bind(trainable: Trainable | None, model: nn.Module, names: Iterable[str]) -> TrainableSets | None:
    """``trainable`` bound to ``model``'s parameters ``names`` (what the state holds), or
    ``None`` when there is no schedule."""
    return None if trainable is None else TrainableSets(trainable, list(names), model_aliases(model))


def model_aliases(model: nn.Module) -> dict[str, str]:
    """``{name: canonical name}`` for every name a parameter of ``model`` is known by (a tied
    weight's other uses included; a canonical name maps to itself)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {a: canonical[id(p)] for a, p in model.named_parameters(remove_duplicate=False)}


def frozen_update(optimizer: Optimizer, update: UpdateFn) -> UpdateFn:
    """The update a step applies under a freezing schedule: ``update`` (one of ``optimizer``'s)
    itself when ``optimizer.partial_grads`` (it takes the trainable parameters' gradients and
    keeps the others frozen by its own rule: ``offload.zenflow``, ``offload.zero_offload``),
    else ``update`` through :func:`update_trainable` (per-parameter counts)."""
    if getattr(optimizer, "partial_grads", False):
        return update
    return lambda grads, state, params: update_trainable(update, grads, state, params)


def update_trainable(update: UpdateFn, grads: Params, state: OptState, params: Params) -> tuple[Params, OptState]:
    """``update`` applied to the parameters that have a gradient in ``grads``; every other
    parameter is frozen. Returns ``(new_params, new_state)`` over all of ``params``.

    Formal Guarantees (``tests/test_freezing.py``):
      * A frozen parameter and every entry of its optimizer state are returned as they are (the
        same tensors): no moment decay, no weight decay, no count
        (``test_frozen_parameters_and_their_state_are_untouched``).
      * Counts are per parameter: ``state["count"]`` becomes ``{name: updates so far}`` (an int
        count, as ``init`` gives, is read as every parameter's), and a parameter's update uses its
        own count, as ``torch.optim`` keeps a step per parameter; so a parameter unfrozen at
        step k starts AdamW's bias correction at its own first update
        (``test_unfrozen_parameter_starts_its_own_count``).
      * With every parameter trainable the result equals ``update`` bit for bit (the rules are
        elementwise; ``test_all_trainable_equals_the_plain_update``).

    The state must be ``{"count": int | {name: int}, slot: {name: tensor}, ...}`` (SGD, AdamW);
    any other entry raises ``TypeError`` naming it (ZenFlow's state is not per parameter).
    Edge cases: empty ``grads`` -> everything returned as is; a gradient for a name not in
    ``params`` -> ``KeyError``."""
    extra = sorted(set(grads) - set(params))
    if extra:
        raise KeyError(f"gradients for names not in params: {extra}")
    slots = _slots(state, params)
    count = state["count"]
    counts = dict(count) if isinstance(count, dict) else {n: count for n in params}
    new_params = dict(params)
    new_slots = {s: dict(v) for s, v in slots.items()}
    groups: dict[int, list[str]] = {}
    for n in params:
        if n in grads:
            groups.setdefault(counts[n], []).append(n)
    for c, group in sorted(groups.items()):
        sub_state = {"count": c, **{s: {n: v[n] for n in group if n in v} for s, v in slots.items()}}
        got_params, got_state = update({n: grads[n] for n in group}, sub_state, {n: params[n] for n in group})
        for n in group:
            new_params[n] = got_params[n]
            counts[n] = got_state["count"]
            for s in slots:
                if n in got_state[s]:
                    new_slots[s][n] = got_state[s][n]
    return new_params, {k: counts if k == "count" else new_slots[k] for k in state}


def _slots(state: OptState, params: Params) -> dict[str, dict]:
    if not isinstance(state, dict) or "count" not in state:
        raise TypeError("freezing needs an optimizer state {'count': ..., slot: {name: tensor}} (SGD, AdamW); "
                        f"got {type(state).__name__}")
    out = {}
    for k, v in state.items():
        if k == "count":
            continue
        if not isinstance(v, dict) or not set(v) <= set(params):
            raise TypeError(f"freezing needs per-parameter optimizer state; entry {k!r} is not a dict over the "
                            "parameters' names")
        out[k] = v
    return out


@contextlib.contextmanager
def values_in(model: nn.Module, tensors: Params) -> Iterator[None]:
    """Inside, the parameters named in ``tensors`` (canonical names) are those tensors in
    ``model``, under every alias of a tied one; put back on exit. A step uses it to run the
    forward with the state's values of its frozen parameters, which get no gradient
    (``functional_call`` reads a parameter it is not given from the module)."""
    if not tensors:
        yield
        return
    swap = {a: tensors[c] for a, c in model_aliases(model).items() if c in tensors}
    accessor = NamedMemberAccessor(model)
    saved, _ = accessor.swap_tensors_dict(swap, allow_missing=False)
    try:
        yield
    finally:
        accessor.swap_tensors_dict(saved, allow_missing=False)
