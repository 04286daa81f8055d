"""Module paths from before the subpackage layout, still importable.

Files saved before the layout pickle some of the package's functions and classes
by their old module path (a stand-in's class, a function rebuilt from its code),
and users may import a module by its old name: both resolve here to the module
that now holds the code, the same module object. The finder goes first in
``sys.meta_path`` (a moved package's old path must not be searched as a folder)
and answers only the package's old names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

PACKAGE = "torch_precompile"
# old path -> new path, under the package; a moved package moves its modules too.
MOVED = {
    "_aot_stage": "stages.aot_autograd",
    "_artifact": "runtime.artifact",
    "_build": "cli.build",
    "_cli": "cli.main",
    "_compat.bytecode_globals": "lean.bytecode_globals",
    "_compat.lean": "lean",
    "_compat.pickling": "lean.pickling",
    "_config_standin": "standin.config",
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
    "file.standin": "standin.module",
    "pythonify": "runtime.pythonify",
}


def new_path(name: str) -> str | None:
    """Where the module ``name`` (an old full path) lives now, or None."""
    if not name.startswith(PACKAGE + "."):
        return None
    rest = name[len(PACKAGE) + 1 :]
    for old, new in MOVED.items():
        if rest == old or rest.startswith(old + "."):
            return f"{PACKAGE}.{new}{rest[len(old) :]}"
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module now at its new path."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if new_path(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(new_path(spec.name) or spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module at the new path ran when it was imported."""


def install() -> None:
    """Answer old module paths (once per process)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
