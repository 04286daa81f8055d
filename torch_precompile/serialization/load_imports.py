"""The modules a file imports where it is loaded, read from what save writes.

Computed at save from the sections' bytes (the pickles read with ``pickletools``,
:mod:`..file.pickle_refs`, never run; the skeleton's JSON; the wrappers' operator
calls) and from the compiled code's globals, and written into the header
(``meta.imports``), so that ``inspect`` lists them without unpickling anything:

- ``load``: what ``Precompile.load`` and a call import on the lean path (and on
  the full path, for a file without lean sections);
- ``fallback``: what only PyTorch's full path (the ``compiled`` sections) or
  Dynamo's own guard manager (a call the lean guards cannot decide) would import,
  and functions rebuilt by value that import their module only if they run.

Each module maps to the places that name it. A file meant to serve without a model
library (a generator) is refused at build when its ``load`` names one
(:func:`library_references`).
"""

from __future__ import annotations

import dis
import re
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _compat
from ..file import sections as names
from ..file.extension import MODEL_LIBRARIES
from ..file.layout import torch_compiled_pickle
from ..file.pickle_refs import pickle_imports
from ..lean.schema import FALLBACK_FIELDS  # nested pickles only Dynamo's guards read
from ..lean.standin.attributes import imported_names

# The operator namespaces torch registers itself (C++ and Python), torch 2.11 to 2.15:
# a graph calling only these runs where torch alone is imported.
TORCH_NAMESPACES = frozenset(
    {
        "aten", "prim", "prims", "rngprims", "debugprims", "inductor", "inductor_prims",
        "_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor", "symm_mem",
        "quantized", "_quantized", "quantization", "mkl", "mkldnn", "mkldnn_prepacked",
        "onednn", "profiler", "sparse", "_native", "streams", "higher_order",
    }
)  # fmt: skip
# ... and those this package registers where it is imported (lean/linear_rows.py): a
# file calling them runs wherever it can be loaded at all.
PROVIDED_NAMESPACES = TORCH_NAMESPACES | {"torch_precompile"}

_OP_CALL = re.compile(rb"torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)")
_MAX_PLACES = 6  # places kept per module in the header

Imports = dict[str, dict[str, list[str]]]  # {"load"|"fallback": {module: [places]}}


def file_imports(
    sections: Mapping[str, bytes | memoryview],
    compiled_functions: Iterable[Any],
    external_refs: Iterable[Mapping[str, list[str]]],
    globals_module: str,
    global_names: Iterable[str],
) -> Imports:
    """The modules a file of ``sections`` imports (see the module docstring)."""
    load: dict[str, list[str]] = {}
    fallback: dict[str, list[str]] = {}

    def add(table: dict[str, list[str]], module: str, place: str) -> None:
        places = table.setdefault(module, [])
        if place not in places and len(places) < _MAX_PLACES:
            places.append(place)

    for name, data in sections.items():
        if name.startswith(names.KERNEL_PREFIX):
            continue
        base = name.split(".")[0]  # variant i's sections, as one place
        if base == names.SKELETON:
            for module, place in skeleton_imports(bytes(data)):
                add(load, module, place)
        elif base == names.COMPILED:
            for ref in pickle_imports(torch_compiled_pickle(data)):
                add(fallback, ref.module, f"{base} (PyTorch's full path): {ref.name}")
        elif base in (names.LEAN, "fastload"):
            for ref in pickle_imports(data):
                where = ref.where.split(".")[0]
                if where in FALLBACK_FIELDS:
                    add(fallback, ref.module, f"{base} {where} (Dynamo's guards): {ref.name}")
                elif ref.lazy:
                    add(fallback, ref.module, f"{base} {where}: a function rebuilt by value")
                else:
                    add(load, ref.module, f"{base} {where or 'spec'}: {ref.name}")
            for namespace, op in sorted(set(_OP_CALL.findall(bytes(data)))):
                ns = namespace.decode()
                if ns not in PROVIDED_NAMESPACES:
                    add(load, ns, f"{base}: the kernels call the operator {ns}::{op.decode()}")
        elif base in (names.SELF, names.DISTRIBUTED_HOOKS):
            for ref in pickle_imports(data):
                target = fallback if ref.lazy else load
                add(target, ref.module, f"{name}: {ref.name}")
    for fn in compiled_functions:
        for module, attr in bytecode_reads(fn):
            add(load, module, f"the compiled bytecode reads {attr}")
    for refs in external_refs:
        for alias, (module, qualname) in refs.items():
            add(load, module, f"the compiled code's global {alias} ({qualname or module})")
    for name in global_names:
        add(load, globals_module, f"the compiled code's global {name}")
    return {"load": _sorted(load), "fallback": _sorted(fallback)}


def _sorted(table: dict[str, list[str]]) -> dict[str, list[str]]:
    return {module: table[module] for module in sorted(table)}


def skeleton_imports(skeleton_json: bytes) -> list[tuple[str, str]]:
    """``(module, place)`` for each module the stand-in imports as it is built (an
    attribute naming a class, function or enum)."""
    import json

    skeleton = json.loads(skeleton_json)
    found = []
    for path, entry in skeleton.get("modules", {}).items():
        for key, encoded in entry.get("attrs", {}).items():
            for module, name in imported_names(encoded):
                where = f"{path}.{key}" if path else key
                found.append((module, f"skeleton: {where} holds {module}.{name}"))
    return found


def bytecode_reads(fn: Any) -> list[tuple[str, str]]:
    """``(module, what)`` for each module the step's bytecode reads a name from at a
    call (the lean load gives it a module that imports itself on first read;
    ``torch._dynamo.utils`` is the lean runtime's own), and for the module that
    defines what it reads there (a function or class of another module, looked up in
    this process, where the module is imported)."""
    code = _compat.compiled_function_bytecode(fn)
    sources = _compat.compiled_function_import_sources(fn)
    if not isinstance(code, types.CodeType) or not sources:
        return []
    found: list[tuple[str, str]] = []
    for unit in _codes(code):
        ins = list(dis.get_instructions(unit))
        for i, x in enumerate(ins):
            module = sources.get(x.argval) if x.opname in ("LOAD_GLOBAL", "LOAD_NAME") else None
            if module is None or module == "torch._dynamo.utils":
                continue
            chain = []
            for after in ins[i + 1 :]:
                if after.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                    break
                chain.append(str(after.argval))
            what = ".".join([module, *chain])
            found.append((module, what))
            home = _defined_in(module, chain)
            if home is not None and home != module:
                found.append((home, what))
    return list(dict.fromkeys(found))


def _defined_in(module: str, chain: list[str]) -> str | None:
    """The module that defines ``module.chain`` (a module, class or function), looked
    up among the modules imported here; None when it is not one."""
    obj: Any = sys.modules.get(module)
    for part in chain:
        obj = getattr(obj, part, None)
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    home = getattr(obj, "__module__", None) if callable(obj) else None
    return home if isinstance(home, str) else None


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def library_references(
    imports: Imports, libraries: tuple[str, ...] = MODEL_LIBRARIES
) -> dict[str, list[str]]:
    """The modules of ``libraries`` a file's load imports, with the places naming them."""
    return {
        module: places
        for module, places in imports["load"].items()
        if module.split(".")[0] in libraries
    }


def top_level(imports: Mapping[str, Any]) -> list[str]:
    """The top-level packages of ``imports``' modules, sorted."""
    return sorted({module.split(".")[0] for module in imports})
