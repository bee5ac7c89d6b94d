"""A train state <-> (a JSON tree, a flat ``{path: Tensor}``), without pickle.

A state is built from dicts with ``str`` keys, lists, tuples, ``None``, ``bool``, ``int``,
``float``, ``str``, tensors, and the registered types (``register_type``). ``ckpt`` knows no
type of its own: each package registers its types where they are defined, when it is imported
(``privacy``: ``TrainState``, ``Accountant``, ``PoissonSampler``, ``DPConfig``; the runtime:
``ShardedState``), and ``ckpt`` imports neither, so a process decodes a type once it has
imported the package that defines it (``tests/test_ckpt_flatten.py::
test_a_type_decodes_once_its_package_is_imported``).
The tree is tagged JSON::

    dict            {"$dict": [[key, node], ...]}        (insertion order kept)
    tuple           {"$tuple": [node, ...]}
    list            [node, ...]
    tensor          {"$tensor": "<path>"}
    inf, -inf, nan  {"$float": "inf" | "-inf" | "nan"}
    registered      {"$type": "<tag>", "value": node}    (value = the type's own encoding)
    None, bool, int, str, finite float: themselves

A tensor's path joins the dict keys and list indices above it with ``/``, each component
percent-escaped (``urllib.parse.quote(.., safe="")``, so a key holding ``/`` cannot forge a
path). Registered types add no component: ``TrainState.params["wte.weight"]`` is
``params/wte.weight``, and ``TrainState.opt_state["mu"]["wte.weight"]`` is
``opt_state/mu/wte.weight``.

Guarantees (``tests/test_ckpt_flatten.py``):
  * ``unflatten(*flatten(s))`` equals ``s``: same types, keys, key order, values, and tensors
    equal bit for bit (``test_round_trip_keeps_types_order_and_bits``).
  * Anything else (a ``Future``, a numpy array, an unregistered NamedTuple or dataclass, a
    non-``str`` dict key) raises ``UnsupportedStateError`` naming its path
    (``test_unsupported_leaf_names_its_path``); nothing is ever pickled.
  * Decoding only rebuilds registered types by tag; an unknown tag is an error, never an import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote

from torch import Tensor

from .errors import UnsupportedStateError

Tree = Any


@dataclass(frozen=True)
class Codec:
    """How one type becomes a tree node and back. ``to_node`` may return tensors inside."""

    tag: str
    cls: type
    to_node: Callable[[Any], Any]
    from_node: Callable[[Any], Any]


_CODECS: dict[str, Codec] = {}


def register_type(tag: str, cls: type, to_node: Callable[[Any], Any], from_node: Callable[[Any], Any]) -> None:
    """Make ``cls`` storable: ``to_node(obj)`` gives a storable value (dicts, lists, tensors,
    ...), ``from_node(value)`` rebuilds the object. Matching is by exact type."""
    _CODECS[tag] = Codec(tag, cls, to_node, from_node)


def _codec_for(obj: Any) -> Codec | None:
    for c in _CODECS.values():
        if type(obj) is c.cls:
            return c
    return None


def join(parts: list[str]) -> str:
    return "/".join(quote(p, safe="") for p in parts)


def _float_node(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def flatten(state: Any) -> tuple[Tree, dict[str, Tensor]]:
    """``(tree, tensors)``: the tagged JSON tree and every tensor leaf by path (not copied)."""
    tensors: dict[str, Tensor] = {}
    return _encode(state, [], tensors), tensors


def _encode(x: Any, parts: list[str], tensors: dict[str, Tensor]) -> Tree:
    if isinstance(x, Tensor):
        path = join(parts)
        tensors[path] = x
        return {"$tensor": path}
    if x is None or isinstance(x, (bool, str)) or type(x) is int:
        return x
    if type(x) is float:
        return _float_node(x)
    codec = _codec_for(x)
    if codec is not None:
        return {"$type": codec.tag, "value": _encode(codec.to_node(x), parts, tensors)}
    if type(x) is dict:
        for k in x:
            if not isinstance(k, str):
                raise UnsupportedStateError(f"at {join(parts) or '<root>'!r}: dict key {k!r} is not a str")
        return {"$dict": [[k, _encode(v, parts + [k], tensors)] for k, v in x.items()]}
    if type(x) is list:
        return [_encode(v, parts + [str(i)], tensors) for i, v in enumerate(x)]
    if type(x) is tuple:
        return {"$tuple": [_encode(v, parts + [str(i)], tensors) for i, v in enumerate(x)]}
    raise UnsupportedStateError(
        f"at {join(parts) or '<root>'!r}: cannot store a {type(x).__module__}.{type(x).__qualname__} without "
        f"pickling; convert it to plain data (offload states: offload.materialize) or ckpt.register_type it"
    )


def unflatten(tree: Tree, tensor_at: Callable[[str], Tensor]) -> Any:
    """Rebuild a state from its tree; ``tensor_at(path)`` supplies each tensor."""
    if tree is None or isinstance(tree, (bool, str, int, float)):
        return tree
    if isinstance(tree, list):
        return [unflatten(v, tensor_at) for v in tree]
    if isinstance(tree, dict) and len(tree) == 1:
        (tag, v), = tree.items()
        if tag == "$tensor":
            return tensor_at(v)
        if tag == "$dict":
            return {k: unflatten(x, tensor_at) for k, x in v}
        if tag == "$tuple":
            return tuple(unflatten(x, tensor_at) for x in v)
        if tag == "$float":
            return float(v)
    if isinstance(tree, dict) and set(tree) == {"$type", "value"}:
        if tree["$type"] not in _CODECS:
            raise UnsupportedStateError(f"unknown type tag {tree['$type']!r}: register it with ckpt.register_type (a "
                                        "package registers its own types when it is imported: import the one that "
                                        "defines it before loading)")
        return _CODECS[tree["$type"]].from_node(unflatten(tree["value"], tensor_at))
    raise UnsupportedStateError(f"malformed state node {str(tree)[:80]!r}")


def contains_type(tree: Tree, tag: str) -> bool:
    """Does the tree hold a node of the registered type ``tag`` (e.g. ``"Accountant"``)?"""
    if isinstance(tree, list):
        return any(contains_type(v, tag) for v in tree)
    if isinstance(tree, dict):
        if tree.get("$type") == tag:
            return True
        return any(contains_type(v, tag) for v in tree.values())
    return False


def top_level(tree: Tree) -> dict[str, Tree]:
    """The first level of a state whose root is a dict or a registered record (e.g.
    ``TrainState``): ``{field: node}``; ``{}`` for anything else."""
    while isinstance(tree, dict) and "$type" in tree:
        tree = tree["value"]
    if isinstance(tree, dict) and "$dict" in tree:
        return {k: v for k, v in tree["$dict"]}
    return {}


