"""Python code a lean load would compile, compiled once at save.

A load builds each variant's guard function and runs Inductor's wrapper from
source, and ``compile()`` of them (hundreds of kilobytes a variant for a
24-layer model) is a large share of a load. The saving process compiles each
once; the lean spec carries the code marshalled, beside the interpreter's
magic number and the source's digest. At load, where both match, the code is
unmarshalled (several times faster); otherwise (another Python, a source made
differently by another version) it is compiled from source as before. The
checksum and the HMAC cover the code as they cover every byte of the file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import types
from typing import Any

MAGIC = importlib.util.MAGIC_NUMBER.hex()  # changes with the interpreter's bytecode


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def compiled(source: str, filename: str) -> dict[str, Any]:
    """``source`` compiled, as the lean spec carries it."""
    code = compile(source, filename, "exec")
    return {"magic": MAGIC, "sha256": _digest(source), "code": marshal.dumps(code)}


def code_for(source: str, filename: str, saved: Any) -> types.CodeType:
    """The code of ``source``: the saved one where it is this interpreter's and of this
    very source (named ``filename`` here), else ``source`` compiled."""
    if (
        isinstance(saved, dict)
        and saved.get("magic") == MAGIC
        and saved.get("sha256") == _digest(source)
    ):
        try:
            code = marshal.loads(saved["code"])
        except (EOFError, KeyError, TypeError, ValueError):
            code = None
        if isinstance(code, types.CodeType):
            return code if code.co_filename == filename else _renamed(code, filename)
    return compile(source, filename, "exec")


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the functions it defines, named ``filename`` (for tracebacks)."""
    consts = tuple(
        _renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)
