"""What a pickle would import, read from its opcodes (``pickletools``), never run.

Unpickling imports the module of every global the stream names (``GLOBAL``,
``STACK_GLOBAL``, ``INST``). :func:`pickle_imports` lists them by walking the
opcodes with a stack of stand-in values (strings, bytes and numbers as
themselves, globals and calls as markers), which is also how it finds:

- pickles nested in a pickle as bytes (a lean section holds its globals and its
  guard tree pickled apart), read the same way;
- the modules the package's rebuilt functions name as a string argument
  (``torch_precompile._stable.named("function")`` imports it at load,
  ``"function-lazy-globals"`` only when the function runs).

Only the standard library here: ``inspect`` reads a file's header without torch.
"""

from __future__ import annotations

import dataclasses
import pickletools
from typing import Any

_STABLE = ("torch_precompile._stable", "named")
# the package's rebuild helpers (``_stable.OBJECTS``) whose second argument is a module
_MODULE_ARGUMENT = {"function": False, "function-lazy-globals": True}  # name -> lazy


@dataclasses.dataclass(frozen=True)
class Ref:
    """One module a pickle needs: ``name`` read from ``module`` (``""``: the module
    itself); ``lazy``: imported only when a rebuilt function runs, not at load;
    ``where``: the key (``a.b`` when nested) of the pickle nested as bytes that names
    it, ``""`` for the pickle itself."""

    module: str
    name: str
    lazy: bool = False
    where: str = ""


@dataclasses.dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclasses.dataclass(frozen=True)
class _Call:
    func: Any
    args: Any


class _Mark:
    pass


_MARK = _Mark()
_OTHER = object()  # a value this reading does not follow (a list, a dict, an object)


def _is_pickle(data: bytes) -> bool:
    """Bytes that open as a pickle of protocol 2 or later (nested pickles are)."""
    return len(data) > 2 and data[0] == 0x80 and 2 <= data[1] <= 5


def pickle_imports(data: bytes | memoryview, depth: int = 0) -> list[Ref]:
    """Every module ``data`` (a pickle) names, with the nested pickles' (in order, each
    once). Raises ``ValueError`` for bytes that are not a whole pickle."""
    found: dict[Ref, None] = {}
    _walk(bytes(data), found, depth, "")
    return list(found)


def _walk(data: bytes, found: dict[Ref, None], depth: int, where: str) -> None:
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise ValueError("a pickle MARK is missing")

    def top() -> Any:
        return stack[-1] if stack else _OTHER

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        if name in ("GLOBAL", "INST"):
            module, _, qual = str(arg).partition(" ")
            found.setdefault(Ref(module, qual, where=where))
            if name == "INST":
                pop_mark()
            stack.append(_Global(module, qual))
        elif name == "STACK_GLOBAL":
            qual, module = stack.pop(), stack.pop()
            if not (isinstance(module, str) and isinstance(qual, str)):
                raise ValueError("STACK_GLOBAL of values that are not strings")
            found.setdefault(Ref(module, qual, where=where))
            stack.append(_Global(module, qual))
        elif name in ("MARK",):
            stack.append(_MARK)
        elif name in ("MEMOIZE",):
            memo[len(memo)] = top()
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = top()
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(int(arg), _OTHER))
        elif name in ("POP",):
            if stack:
                stack.pop()
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(top())
        elif name in ("EMPTY_TUPLE",):
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = stack.pop(), stack.pop()
            _note_call(func, args, found, where)
            stack.append(_Call(func, args))
        elif name == "NEWOBJ_EX":
            stack.pop(), stack.pop()
            stack.append(_Call(stack.pop(), ()))
        elif name == "OBJ":
            items = pop_mark()
            stack.append(_Call(items[0] if items else _OTHER, tuple(items[1:])))
        elif name in ("BUILD", "APPEND", "SETITEM"):
            for _ in range(1 if name != "SETITEM" else 2):
                stack.pop()
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            pop_mark()
        elif name in ("FROZENSET", "LIST", "DICT"):
            pop_mark()
            stack.append(_OTHER)
        elif name in ("BINPERSID",):
            stack.pop()
            stack.append(_OTHER)
        elif name in ("STRING", "BINSTRING", "SHORT_BINSTRING"):
            stack.append(arg)
        elif isinstance(arg, (bytes, bytearray)):  # BINBYTES*, BYTEARRAY8
            if depth < 8 and _is_pickle(bytes(arg)):
                key = top() if isinstance(top(), str) else "?"  # a dict's key, pushed before
                try:
                    _walk(bytes(arg), found, depth + 1, f"{where}.{key}" if where else key)
                except (ValueError, IndexError):
                    pass  # bytes that only begin as a pickle does
            stack.append(bytes(arg))
        elif name in ("NEXT_BUFFER", "READONLY_BUFFER", "PERSID", "EXT1", "EXT2", "EXT4"):
            if name == "READONLY_BUFFER":
                continue
            stack.append(_OTHER)
        elif op.stack_after:  # a number, a string, None, a bool, an empty container
            stack.append(arg if arg is not None or name == "NONE" else _OTHER)
        else:
            raise ValueError(f"pickle opcode {name} is not read here")


def _note_call(func: Any, args: Any, found: dict[Ref, None], where: str) -> None:
    """A rebuilt function of the package names its module as an argument: that module."""
    if not (isinstance(func, _Call) and isinstance(args, tuple) and len(args) > 1):
        return
    inner = func.func
    if not (isinstance(inner, _Global) and (inner.module, inner.name) == _STABLE):
        return
    stable = func.args[0] if isinstance(func.args, tuple) and func.args else None
    if stable in _MODULE_ARGUMENT and isinstance(args[1], str):
        found.setdefault(Ref(args[1], "", lazy=_MODULE_ARGUMENT[stable], where=where))
