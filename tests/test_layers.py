"""The packages form layers and every import points down (or sideways within a layer).

    3  fsdpx.train  fsdpx.jobs           the job, its data, CLI, launcher; the multi-job planner
    2  fsdpx.runtime                     the sharded step, gathering, comm backends
    1  privacy  offload  ckpt            DP-SGD, selective offload, checkpoints
    0  fsdpx.sharding  fsdpx.optim  fsdpx.models   the algebra, optimizers, the reference GPT

Every ``import`` statement of every module is read, the ones inside functions included, so a
lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fsdpx", "privacy", "offload", "ckpt")
LAYERS = {
    "fsdpx.sharding": 0, "fsdpx.optim": 0, "fsdpx.models": 0,
    "privacy": 1, "offload": 1, "ckpt": 1,
    "fsdpx.runtime": 2,
    "fsdpx.train": 3, "fsdpx.jobs": 3, "fsdpx.__main__": 3,
}


def layer_of(module: str) -> int | None:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else LAYERS[best]


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
