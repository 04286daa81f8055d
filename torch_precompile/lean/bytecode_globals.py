"""The globals of Dynamo's transformed bytecode at a lean load, and the function.

Dynamo's bytecode names, as globals, every module its sources went through (a
model library's modules, ``torch._dynamo.polyfills``, ``torch._dynamo.utils``)
but at run time reads few of them. A lean load imports none of them: each is
a module that imports itself when the bytecode first reads from it, and the
few helpers of ``torch._dynamo.utils`` the bytecode calls are written here.
"""

from __future__ import annotations

import importlib
import itertools
import pickle
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import profiler as _profiler_state

from .._stable import today
from .pickling import loads_code
from .standin.config import find

if TYPE_CHECKING:
    from .schema import LeanSection


class _DynamoUtils:
    """``torch._dynamo.utils`` as Dynamo's bytecode uses it, without importing Dynamo.

    The bytecode brackets its pre-graph work with two profiler markers and, with
    dynamic shapes, reads sizes through ``call_size`` (Dynamo's versions only
    add ``torch._disable_dynamo``, moot outside Dynamo); under tensor parallelism
    it reads a hook dict's key with ``dict_keys_getitem``; any other name is taken
    from the real module (imported on first use).
    """

    @staticmethod
    def record_pregraph_bytecode_enter() -> Any:
        if not _profiler_state._is_profiler_enabled:
            return None  # the common case: nothing to record, nothing to allocate
        cm = torch._C._profiler._RecordFunctionFast("Pregraph bytecode")
        cm.__enter__()
        return cm

    @staticmethod
    def record_pregraph_bytecode_exit(cm: Any) -> None:
        if cm is not None:
            cm.__exit__(None, None, None)

    # Dynamic shapes: the bytecode passes sizes, strides and offsets as graph inputs.
    @staticmethod
    def call_size(x: Any, i: int) -> int:
        return x.size(i)

    @staticmethod
    def call_stride(x: Any, i: int) -> int:
        return x.stride(i)

    @staticmethod
    def call_storage_offset(x: Any) -> int:
        return x.storage_offset()

    # A dict's n-th key in its own order (a parallelisation hook's key, under TP).
    @staticmethod
    def dict_keys_getitem(d: dict[Any, Any], n: int) -> Any:
        return next(itertools.islice(dict.keys(d), n, n + 1))

    # Side effects replayed after the graph: an attribute written to (or deleted
    # from) an object's instance dict, as Dynamo's helpers do for plain objects.
    @staticmethod
    def object_setattr_ignore_descriptor(obj: Any, name: str, value: Any) -> None:
        _instance_dict(obj)[name] = value

    @staticmethod
    def object_delattr_ignore_descriptor(obj: Any, name: str) -> None:
        del _instance_dict(obj)[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo.utils"), name)


def _instance_dict(obj: Any) -> dict[str, Any]:
    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        if not isinstance(obj, threading.local):
            raise
        return threading.local.__getattribute__(obj, "__dict__")  # type: ignore[no-any-return]


class _LazyModule(types.ModuleType):
    """A module imported on first attribute access; named as the module, so that
    identity guards on the global (a module, by name) hold without importing it.

    ``homes``: names the module re-exports from elsewhere (``modeling_llama``'s
    ``CausalLMOutputWithPast`` is ``modeling_outputs``'s), as ``[module,
    qualname]`` where each was defined: read from there, without importing this
    module. They were the same object at save; until this module is imported
    nothing can have rebound them, and once it is, the artifact's identity
    guards on its globals are checked.
    """

    def __init__(self, name: str, homes: dict[str, list[str]] | None = None) -> None:
        super().__init__(name)
        self.__homes = homes or {}

    def __getattr__(self, attr: str) -> Any:
        home = self.__homes.get(attr)
        if home is not None and self.__name__ not in sys.modules:
            return find(today(home[0]), home[1])
        return getattr(importlib.import_module(today(self.__name__)), attr)


def global_homes(code: types.CodeType, import_sources: Mapping[str, str]) -> dict[str, Any]:
    """For each module the bytecode names, the classes and functions it may read from
    it that are defined in another module: ``{alias: {name: [module, qualname]}}``."""
    homes: dict[str, dict[str, list[str]]] = {}
    for alias, module_name in import_sources.items():
        module = sys.modules.get(module_name)
        if module is None or module_name.startswith("torch"):
            continue
        for name in code.co_names:
            value = getattr(module, name, None)
            if not isinstance(value, (type, types.FunctionType)):
                continue
            home, qualname = value.__module__, value.__qualname__
            if home == module_name or "<locals>" in qualname:
                continue
            if find(home, qualname, import_missing=False) is value:
                homes.setdefault(alias, {})[name] = [home, qualname]
    return homes


def _bytecode_global_module(module_name: str, homes: dict[str, list[str]] | None = None) -> Any:
    """What a bytecode's global names for ``module_name``: the module if imported,
    else a stand-in that imports it when the bytecode first reads from it.

    Dynamo's bytecode names every module its sources went through (a model
    library's modules, ``torch._dynamo.polyfills``) but at run time reads few of
    them, often none: a load imports none of them.
    """
    if module_name == "torch._dynamo.utils":
        return _DynamoUtils()
    loaded = sys.modules.get(today(module_name))
    return loaded if loaded is not None else _LazyModule(module_name, homes)


def bytecode_function(
    spec: LeanSection,
    graph_call: Callable[..., Any],
    module_globals: dict[str, Any] | None = None,
) -> types.FunctionType:
    """Dynamo's transformed bytecode as a function, with the graph bound to its backend name."""

    f_globals: dict[str, Any] = {
        alias: _bytecode_global_module(module_name, spec.global_homes.get(alias))
        for alias, module_name in spec.import_sources.items()
    }
    f_globals.update(pickle.loads(spec.used_globals))
    f_globals.update(module_globals or {})  # e.g. an output dataclass, as PyTorch's path does
    f_globals["__builtins__"] = __builtins__
    f_globals[spec.backend_id] = graph_call
    code = loads_code(spec.bytecode)
    closure = None
    if spec.closure is not None:
        closure = tuple(types.CellType(v) for v in pickle.loads(spec.closure))
    fn = types.FunctionType(code, f_globals, code.co_name, spec.argdefs, closure)
    if spec.kwdefaults:
        fn.__kwdefaults__ = spec.kwdefaults
    return fn
