"""Functions named by reference, ``"module:qualname"``: how a run names the Python functions that
build its model, its data and its loss, so that a process started by torchrun (which shares no
memory with the one that configured it) imports the very same functions.

    ref = function_ref(make_model)         # "mylab.models:make_model", or NotImportableError
    resolve_ref(ref) is make_model         # in any process whose sys.path holds mylab
    import_root("mylab.models")            # the sys.path entry it was imported from
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Callable

from .config import ConfigError


class NotImportableError(ConfigError):
    """A function another process could not import by name: a lambda, a function defined inside
    another, one defined in the script run as ``__main__``, or a callable that is no module
    attribute; or a reference that does not resolve."""


FIX = ("define it with `def` at the top level of a module the workers can import (a file of an installed"
       " package, or beside the modules on this process's sys.path), not in the script run as __main__")


def function_ref(fn: Callable[..., Any]) -> str:
    """``"module:qualname"`` of ``fn``, checked to resolve back to ``fn`` in this process.

    Formal Guarantees: a returned reference ``r`` has ``resolve_ref(r) == fn`` here, its module
    is not ``__main__`` and its qualname holds no ``<lambda>`` or ``<locals>``, so a process
    with this process's import roots (:func:`import_root`) resolves it to the same code.

    Raises :class:`NotImportableError` saying what ``fn`` is and how to fix it:

    ===============================  =======================================
    ``fn``                           error
    ===============================  =======================================
    ``lambda h: ...``                a lambda
    a ``def`` inside a function      defined inside ``outer`` (``<locals>``)
    ``__module__ == "__main__"``     defined in the script run as __main__
    ``functools.partial``, objects   no ``__module__``/``__qualname__``
    a name rebound after definition  resolves to another object
    ===============================  ======================================="""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(module, str) or not isinstance(qualname, str):
        raise NotImportableError(f"{fn!r} is not a function with a module and a name; {FIX}")
    if "<lambda>" in qualname:
        raise NotImportableError(f"{module}.{qualname} is a lambda; {FIX}")
    if "<locals>" in qualname:
        raise NotImportableError(f"{module}.{qualname} is defined inside "
                                 f"{qualname.split('.<locals>')[0]}; {FIX}")
    if module == "__main__":
        raise NotImportableError(f"{qualname} is defined in the script run as __main__, which a worker does not"
                                 f" run; {FIX}")
    ref = f"{module}:{qualname}"
    try:
        found = resolve_ref(ref)
    except NotImportableError as e:
        raise NotImportableError(f"{e}; {FIX}") from None
    if not (found is fn or found == fn):
        raise NotImportableError(f"{ref} names another object than the function given (was the name rebound?);"
                                 f" {FIX}")
    return ref


def resolve_ref(ref: str) -> Any:
    """The object ``"module:qualname"`` names (the module imported). Raises
    :class:`NotImportableError` for a malformed reference, a module that does not import or
    a missing attribute."""
    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise NotImportableError(f"{ref!r} is not a reference \"module:qualname\"")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise NotImportableError(f"{ref}: module {module!r} does not import here ({e})") from None
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise NotImportableError(f"{ref}: {module} has no {qualname}") from None
    return obj


def import_root(module: str) -> str | None:
    """The ``sys.path`` directory this process imported ``module`` from (so another process
    given it on its path imports the same file); None for a built-in or namespace module."""
    mod = sys.modules.get(module) or importlib.import_module(module)
    file = getattr(mod, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve().parent
    depth = module.count(".") + (1 if Path(file).name.startswith("__init__.") else 0)
    for _ in range(depth):
        path = path.parent
    return str(path)
