"""The one table of the package's code that a file refers to, by stable name.

A file's own pickles name the package's functions by a **stable name** (an entry
of :data:`OBJECTS`, read back through :func:`named`), never by module path: moving
one of them changes its row here and nothing else. This module's path and
:func:`named` are part of the file format and never move.

Some module paths a file holds are not ours to choose: PyTorch writes the module
of the code it traced (a generator's step: its globals, its guards, its compiled
function) and files written before stable names named the functions above by
module path. :data:`MOVED` maps each such path to where the code is today; a
load reads the file with those paths answered (:func:`moved_modules_answered`),
and the places that import a module named in a file go through :func:`today`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

PACKAGE = "torch_precompile"

# stable name -> today's "module:qualname"
OBJECTS: dict[str, str] = {
    "code": f"{PACKAGE}.lean.pickling:_code",
    "cell": f"{PACKAGE}.lean.pickling:_cell",
    "function": f"{PACKAGE}.lean.pickling:_rebuild_function",
    "function-lazy-globals": f"{PACKAGE}.lean.pickling:_function_with_module_globals",
    "dict-config": f"{PACKAGE}.lean.standin.config:rebuild_dict_config",
}

# a module path a file may hold (under the package) -> today's; a moved package
# moves its modules too.
MOVED: dict[str, str] = {
    # before the subpackage layout (2026-11-26)
    "_aot_stage": "stages.aot_autograd",
    "_artifact": "runtime.artifact",
    "_build": "cli.build",
    "_cli": "cli.main",
    "_compat.bytecode_globals": "lean.bytecode_globals",
    "_compat.lean": "lean",
    "_compat.pickling": "lean.pickling",
    "_config_standin": "lean.standin.config",
    "_dynamo_stage": "stages.dynamo",
    "_handoff": "stages.handoff",
    "_index_bounds": "stages.index_bounds",
    "_inductor_stage": "stages.inductor",
    "_output_layout": "runtime.output_layout",
    "_output_structure": "stages.output_structure",
    "_precompile_stage": "stages.precompile",
    "_preserve": "stages.snapshot",
    "_runtime": "runtime.call",
    "_settle": "stages.first_call",
    "_signature": "runtime.signature",
    "_size_one": "stages.size_one",
    "_system": "runtime.machine",
    "data_parallel": "distributed.data_parallel",
    "file.load": "serialization.load",
    "file.save": "serialization.save",
    "file.standin": "lean.standin.module",
    "pythonify": "runtime.pythonify",
    # one name per module (2026-11-27): the generator's traced step
    "generation.generator": "generation.compile",
    # the stand-ins are the lean runtime's (2026-11-28)
    "standin": "lean.standin",
}


def today(module: str) -> str:
    """Where the module a file names (``module``, a full path) is today."""
    if not module.startswith(PACKAGE + "."):
        return module
    rest = module[len(PACKAGE) + 1 :]
    for old, new in MOVED.items():
        if rest == old or rest.startswith(old + "."):
            return f"{PACKAGE}.{new}{rest[len(old) :]}"
    return module


def named(name: str) -> Any:
    """The object with stable name ``name`` (a file's pickles call this)."""
    try:
        module, qualname = OBJECTS[name].split(":")
    except KeyError:
        raise LookupError(
            f"the file names {name!r}, which this torch_precompile does not know: it was "
            "written by a newer one; upgrade torch_precompile to load it"
        ) from None
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_BY_PATH = {path: name for name, path in OBJECTS.items()}


def stable_reduction(obj: Any) -> tuple[Any, tuple[str]] | None:
    """A pickle reduction naming ``obj`` by its stable name, or None if it has none."""
    if not isinstance(obj, (types.FunctionType, type)):
        return None
    name = _BY_PATH.get(f"{getattr(obj, '__module__', '')}:{obj.__qualname__}")
    if name is None or named(name) is not obj:
        return None
    return named, (name,)


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module path as the module at today's path (the same object)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if today(fullname) == fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(today(spec.name))

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module at today's path ran when it was imported."""


_FINDER = _Moved()
_LOCK = threading.Lock()
_DEPTH = 0


@contextlib.contextmanager
def moved_modules_answered() -> Iterator[None]:
    """While a file is read: an import of a moved path (PyTorch's unpickling, Dynamo's
    import of a traced module) gets today's module. The finder goes first (a moved
    package's old path must not be searched as a folder) and answers only
    :data:`MOVED`'s paths; it is removed when the last reader leaves."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            sys.meta_path.insert(0, _FINDER)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                sys.meta_path.remove(_FINDER)
