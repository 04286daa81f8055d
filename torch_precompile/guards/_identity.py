"""What identifies a function, class or module across processes.

Dynamo guards functions, classes and modules by ``id()``, which means nothing
in another process, so PyTorch refuses to save those guards. Each becomes an
identity that can be saved: a function by qualified name, file and a hash of
its bytecode; a class or builtin by module and qualified name; a module by name.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import types
from typing import Any


def code_hash(code: types.CodeType) -> str:
    """SHA-256 of a code object's bytecode, names and constants (nested code included)."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Identity:
    """``what`` is function, code, module, class or builtin; unused fields are empty.

    ``file`` is shown, not compared: the same code installed at another path (the
    serving machine's virtual environment) is the same code.
    """

    what: str
    module: str | None = None
    qualname: str | None = None
    file: str | None = dataclasses.field(default=None, compare=False)
    code_hash: str | None = None
    name: str | None = None

    def __str__(self) -> str:
        if self.what == "module":
            return f"module {self.name}"
        if self.what in ("function", "code"):
            where = f"{self.module}." if self.module else ""
            digest = (self.code_hash or "")[:12]
            return f"{self.what} {where}{self.qualname} ({self.file}, bytecode sha256 {digest})"
        return f"{self.what} {self.module}.{self.qualname}"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Identity:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def identity_of(value: Any) -> Identity | None:
    """What identifies ``value`` across processes, or None if nothing does."""
    fn = value
    if isinstance(fn, functools.partial):
        return None
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        return Identity(
            "function",
            module=getattr(fn, "__module__", None),
            qualname=fn.__qualname__,
            file=code.co_filename,
            code_hash=code_hash(code),
        )
    if isinstance(fn, types.CodeType):
        return Identity(
            "code", qualname=fn.co_qualname, file=fn.co_filename, code_hash=code_hash(fn)
        )
    if isinstance(fn, types.ModuleType):
        return Identity("module", name=fn.__name__)
    if isinstance(fn, (type, types.BuiltinFunctionType)):
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if module is None or qualname is None:
            return None
        return Identity("class" if isinstance(fn, type) else "builtin", module, qualname)
    return None


def installed_library(module: str) -> tuple[str, str] | None:
    """(distribution, version) of the installed package that provides ``module``, or
    None (the standard library, a script's module, a package without metadata).

    Read from the package's metadata, without importing it.
    """
    return _installed(module.split(".", 1)[0])


@functools.cache
def _installed(top: str) -> tuple[str, str] | None:
    """:func:`installed_library` of a top-level package (its metadata read once: a
    generator's guards name a dozen modules of one library)."""
    try:
        return top, importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
