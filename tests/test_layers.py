"""The packages form layers and every import points down (or sideways within a layer).

    4  fsdpx.cli  fsdpx.__main__         the ``fsdpx`` front door: dispatches train, jobs, schedule, export
    3  fsdpx.train  fsdpx.jobs           the job, its data, CLI, launcher; the multi-job planner
    2  fsdpx.runtime                     the sharded step, gathering, comm backends
    1  privacy  offload  ckpt            DP-SGD, selective offload, checkpoints
    0  fsdpx.sharding  fsdpx.optim  fsdpx.models   the algebra, optimizers, the reference GPT

Every ``import`` statement of every module is read, the ones inside functions included, so a
lazy import cannot hide an upward dependency. Over the same imports: the module graph and the
graph of the packages above have no cycle (a lazy import that only dodges a circle at import
time still ties the two modules into one), and no module takes a ``_private`` name of another
module of the library (``from m import _x``, or ``m._x`` on an imported module): what two
modules share is public where it lives. Nothing is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Mapping

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fsdpx", "privacy", "offload", "ckpt")
LAYERS = {
    "fsdpx.sharding": 0, "fsdpx.optim": 0, "fsdpx.models": 0,
    "privacy": 1, "offload": 1, "ckpt": 1,
    "fsdpx.runtime": 2,
    "fsdpx.train": 3, "fsdpx.jobs": 3,
    "fsdpx.cli": 4, "fsdpx.__main__": 4,
}


def package_of(module: str) -> str | None:
    """The package of ``LAYERS`` that holds ``module`` (``fsdpx.runtime`` for
    ``fsdpx.runtime.step``), ``None`` outside them."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)


def layer_of(module: str) -> int | None:
    package = package_of(module)
    return None if package is None else LAYERS[package]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in the file, relative ones resolved."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import of the library in ``source``, the code of
    ``module`` (a package's ``__init__`` when ``is_pkg``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, module, is_pkg)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if layer_of(sub) is not None and _is_module(sub) else mod))
    return [(line, m) for line, m in out if m.split(".")[0] in PACKAGES]


def _from_module(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    """The absolute module of ``from <module> import ...``, a relative one resolved."""
    if not node.level:
        return node.module or ""
    here = module.split(".")
    base = here if is_pkg else here[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_module_has_a_layer():
    missing = [module_name(p) for p in project_files() if module_name(p) != "fsdpx" and layer_of(module_name(p)) is None]
    assert not missing, f"modules outside every layer: {missing}; add their package to LAYERS"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in project_files():
        me = module_name(path)
        if me == "fsdpx":
            continue  # the facade: lazy re-exports only, checked below
        for line, target in imports_of(path):
            if target == "fsdpx":
                upward.append(f"{path.relative_to(ROOT)}:{line} imports the fsdpx facade; import the subpackage")
            elif layer_of(target) is not None and layer_of(target) > layer_of(me):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({me}, layer {layer_of(me)}) imports {target}"
                              f" (layer {layer_of(target)})")
    assert not upward, "\n".join(upward)


def test_the_facade_imports_nothing_eagerly():
    tree = ast.parse((ROOT / "fsdpx" / "__init__.py").read_text())
    eager = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
             and not (isinstance(n, ast.ImportFrom) and n.module == "__future__") and
             not (isinstance(n, ast.Import) and n.names[0].name in ("importlib",))
             and not (isinstance(n, ast.ImportFrom) and n.module == "typing")]
    assert not eager, f"fsdpx/__init__.py imports at lines {eager}: importing fsdpx.sharding would load them"


def test_the_layer_check_sees_lazy_and_relative_imports():
    """The checker itself: an import inside a function and a relative import are both found."""
    source = "from .gather import Gatherer\n\ndef f():\n    from privacy.layers import rule_for\n"
    found = {m for _, m in imports_in(source, "fsdpx.runtime.step", is_pkg=False)}
    assert found == {"fsdpx.runtime.gather", "privacy.layers"}
    assert "fsdpx.runtime.gather" in {m for _, m in imports_of(ROOT / "fsdpx" / "runtime" / "step.py")}


def import_graph() -> dict[str, dict[str, str]]:
    """``{module: {imported module: "module:line" of its first import}}`` over the library."""
    graph: dict[str, dict[str, str]] = {}
    for path in project_files():
        me = module_name(path)
        edges = graph.setdefault(me, {})
        for line, target in sorted(imports_of(path)):
            if target != me:
                edges.setdefault(target, f"{me}:{line}")
    return graph


def package_graph(graph: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """``{package: {imported package: "module:line" of the first import that makes it}}``."""
    out: dict[str, dict[str, str]] = {}
    for me, edges in graph.items():
        mine = package_of(me)
        for target, where in edges.items():
            theirs = package_of(target)
            if mine and theirs and mine != theirs:
                out.setdefault(mine, {}).setdefault(theirs, where)
    return out


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle of every strongly connected part of ``graph`` with more than one node (a node
    importing itself is not counted), as the chain ``[a, b, ..., a]``: empty iff acyclic."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules deep at most
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                parts.append(part)

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return [_chain(graph, min(part), set(part)) for part in parts]


def _chain(graph: Mapping[str, Iterable[str]], start: str, inside: set[str]) -> list[str]:
    """The shortest path from ``start`` back to itself within ``inside`` (breadth first)."""
    came = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]  # back from v to start, then turned around
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return path[::-1] + [start]
                if w in inside and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")


def _describe(chain: list[str], graph: Mapping[str, Mapping[str, str]]) -> str:
    """``a -> b (at a:12) -> a (at b:3)``: each step with the import that makes it."""
    return " -> ".join([chain[0]] + [f"{b} (at {graph[a][b]})" for a, b in zip(chain, chain[1:])])


def test_the_module_import_graph_has_no_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_the_package_import_graph_has_no_cycle():
    """Sideways imports within a layer go one way: ``privacy`` may use ``ckpt`` or the reverse,
    never both; a layer's packages stay separable."""
    graph = package_graph(import_graph())
    found = cycles(graph)
    assert not found, "package cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def private_imports(source: str, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    """``(line, "module._name")`` for every ``_private`` (not dunder) name ``source`` takes from
    another module of the library: ``from m import _x``, and ``m._x`` where ``m`` is bound by an
    import to a library module (``import a.b as m``, ``from a import b`` of a module ``a.b``,
    ``import a.b`` then ``a.b._x``)."""
    tree = ast.parse(source)
    out, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, module, is_pkg)
            for a in node.names:
                if _private(a.name) and mod.split(".")[0] in PACKAGES:
                    out.append((node.lineno, f"{mod}.{a.name}"))
                if _is_module(f"{mod}.{a.name}"):
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value, bound)
            if owner is not None and owner.split(".")[0] in PACKAGES and _is_module(owner) and owner != module:
                out.append((node.lineno, f"{owner}.{node.attr}"))
    return sorted(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.expr, bound: Mapping[str, str]) -> str | None:
    """The module an expression names (``a.b.c`` with ``a`` an imported module), else None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bound)
        return None if base is None else f"{base}.{node.attr}"
    return None


def test_no_module_takes_a_private_name_of_another():
    found = []
    for path in project_files():
        for line, name in private_imports(path.read_text(), module_name(path), path.name == "__init__.py"):
            found.append(f"{path.relative_to(ROOT)}:{line} takes {name}: make it public where it lives, or move it")
    assert not found, "\n".join(found)


def test_the_checks_see_a_cycle_and_a_private_name():
    """The checkers themselves: a cycle is reported as its chain, only once, and each form of
    taking a private name is found (a dunder and a third-party private name are not)."""
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = ("from fsdpx.runtime.step import _x, make_sharded_step, __doc__\n"
              "from torch.nn.modules.batchnorm import _BatchNorm\n"
              "from . import gather\n"
              "import fsdpx.runtime.reduce as R\n"
              "import privacy.clipping\n"
              "def f():\n"
              "    from .units import _y\n"
              "    return gather._z, R._w, privacy.clipping._v, gather.Gatherer\n")
    assert private_imports(source, "fsdpx.runtime.pipeline", is_pkg=False) == [
        (1, "fsdpx.runtime.step._x"), (7, "fsdpx.runtime.units._y"), (8, "fsdpx.runtime.gather._z"),
        (8, "fsdpx.runtime.reduce._w"), (8, "privacy.clipping._v")]
