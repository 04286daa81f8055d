"""The package's pickling: its own objects by stable name (:func:`dumps`, and PyTorch's
picklers patched to do the same), and functions by value where PyTorch's picklers would
save a name that another process cannot import (functions defined inside functions,
``__main__``)."""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import io
import marshal
import pickle
import types
from collections.abc import Callable, Iterator
from typing import Any

from .._stable import stable_reduction, today
from .standin.config import find


class _StablePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        return stable_reduction(obj) or NotImplemented


def dumps(obj: Any) -> bytes:
    """``pickle.dumps``, the package's objects by stable name (``_stable.OBJECTS``)."""
    buffer = io.BytesIO()
    _StablePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


@contextlib.contextmanager
def reducer_override_patched(pickler: type, override: Callable[..., Any]) -> Iterator[None]:
    """Swap a PyTorch pickler's reducer_override for the duration of one save; the
    package's own functions go by stable name first, as in every pickle it writes."""
    original = pickler.reducer_override

    def stable_first(self: Any, obj: Any) -> Any:
        return stable_reduction(obj) or override(self, obj)

    pickler.reducer_override = stable_first  # type: ignore[method-assign]
    try:
        yield
    finally:
        pickler.reducer_override = original  # type: ignore[method-assign]


def findable_by_name(fn: types.FunctionType) -> bool:
    """Whether pickle can find ``fn`` by module and qualified name (it is that object)."""
    if "<locals>" in fn.__qualname__:
        return False
    return find(fn.__module__, fn.__qualname__, import_missing=False) is fn


def _function(
    code: types.CodeType,
    f_globals: dict[str, Any],
    name: str,
    qualname: str,
    defaults: tuple[Any, ...] | None,
    kwdefaults: dict[str, Any] | None,
    closure: tuple[Any, ...] | None,
    attrs: dict[str, Any],
) -> types.FunctionType:
    fn = types.FunctionType(code, f_globals, name, defaults, closure)
    fn.__qualname__ = qualname
    fn.__kwdefaults__ = kwdefaults
    fn.__dict__.update(attrs)
    return fn


def _rebuild_function(code: types.CodeType, module: str, *rest: Any) -> types.FunctionType:
    """Inverse of :func:`function_by_value`: the function in its imported module."""
    try:
        f_globals = importlib.import_module(today(module)).__dict__
    except ImportError:
        # The code runs nowhere (Dynamo traced it into the graph); it is kept
        # so that guards and closures that hold it can be rebuilt.
        f_globals = {"__name__": module, "__builtins__": __builtins__}
    return _function(code, f_globals, *rest)


def function_by_value(fn: types.FunctionType) -> tuple[Any, tuple[Any, ...]]:
    """A pickle reduction that rebuilds ``fn`` from its code, not its name."""
    return _rebuild_function, (
        fn.__code__,
        fn.__module__,
        fn.__name__,
        fn.__qualname__,
        fn.__defaults__,
        fn.__kwdefaults__,
        fn.__closure__,
        dict(fn.__dict__),
    )


class _ModuleGlobals(dict):  # type: ignore[type-arg]
    """A rebuilt function's globals: its module's, imported when a name is first read.

    The function is kept for what guards and closures read off it (defaults,
    attributes); its code ran in Dynamo's trace, so its module is imported only if
    it is ever called. Built-in names never import it.
    """

    def __init__(self, module: str) -> None:
        super().__init__(__name__=module, __builtins__=builtins)
        self.module = module

    def __missing__(self, key: str) -> Any:
        if hasattr(builtins, key):
            raise KeyError(key)  # LOAD_GLOBAL then looks in the builtins
        return importlib.import_module(today(self.module)).__dict__[key]


def _function_with_module_globals(
    code: types.CodeType, module: str, *rest: Any
) -> types.FunctionType:
    """Inverse of :func:`function_by_value`, its module imported only when the code runs."""
    return _function(code, _ModuleGlobals(module), *rest)


def function_from_code(
    code: types.CodeType,
    module: str,
    qualname: str,
    defaults: tuple[Any, ...] | None,
    kwdefaults: dict[str, Any] | None,
) -> types.FunctionType:
    """A function rebuilt from its code, named as in ``module``, which is imported only
    if the function runs (a stand-in's attribute: guards compare it, nothing calls it)."""
    name = qualname.rsplit(".", 1)[-1]
    return _function(code, _ModuleGlobals(module), name, qualname, defaults, kwdefaults, None, {})


def _cell(contents: Any) -> types.CellType:
    return types.CellType(contents)


def _code(stripped: bytes, consts: tuple[Any, ...]) -> types.CodeType:
    return marshal.loads(stripped).replace(co_consts=consts)  # type: ignore[no-any-return]


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    """A code object as marshal's bytes without its constants, and the constants
    pickled: Dynamo's bytecode holds dtypes and devices, which marshal cannot write."""
    stripped = code.replace(co_consts=(None,) * len(code.co_consts))
    return _code, (marshal.dumps(stripped), code.co_consts)


class _LeanPickler(pickle.Pickler):
    """Functions pickle cannot find by name go by value, their globals by module name;
    the package's own functions by stable name."""

    def reducer_override(self, obj: Any) -> Any:
        stable = stable_reduction(obj)
        if stable is not None:
            return stable
        if isinstance(obj, types.CodeType):
            return _reduce_code(obj)
        if isinstance(obj, types.CellType):
            return _cell, (obj.cell_contents,)
        if inspect.isfunction(obj) and not findable_by_name(obj):
            return _function_with_module_globals, function_by_value(obj)[1]
        return NotImplemented


def dumps_lean(obj: Any) -> bytes:
    """Pickle ``obj`` so that loading it imports no module a rebuilt function lives in
    (functions are by value where pickle cannot find them by name)."""
    buffer = io.BytesIO()
    _LeanPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads_code(data: bytes) -> types.CodeType:
    """A code object written by :func:`dumps_lean` (or, in older files, by marshal)."""
    # A pickle (protocol 2 or later) starts with 0x80; marshal's code objects do not.
    code = pickle.loads(data) if data[:1] == b"\x80" else marshal.loads(data)
    if not isinstance(code, types.CodeType):
        raise ValueError("the lean section does not hold a code object")
    return code
