"""Guards on dynamic shapes: the range each dynamic size serves, and relations between sizes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ._base import Call, Guard, Reader, _resolve
from ._python import Code, Parts, render, shape_text
from ._source import MISSING, Source, describe_source

_SYMBOL = re.compile(r"\b[a-z]+\d+\b")


# -------------------------------------------------------- dynamic shapes


@dataclasses.dataclass(frozen=True)
class RangeGuard(Guard):
    """The sizes one dynamic dimension serves: ``min <= size <= max`` (None: no bound)."""

    source: str = ""
    dim: int = 0
    symbol: str = ""
    min: int = 0
    max: int | None = None
    note: str = ""
    kind: ClassVar[str] = "range"

    @property
    def subject(self) -> str:
        return self.source

    def size(self, f_locals: dict[str, Any]) -> int | None:
        t = Source.parse(self.source)
        value = t.resolve(f_locals) if t is not None else MISSING
        if isinstance(value, torch.Tensor) and self.dim < value.dim():
            return int(value.shape[self.dim])
        return None

    def problem(self, call: Call) -> str | None:
        size = self.size(call.f_locals)
        if size is None or (self.min <= size and (self.max is None or size <= self.max)):
            return None
        value = _resolve(self.source, call)
        note = self.note if size < self._note_below else ""
        return render(self._outside(str(size), shape_text(tuple(value.shape)), note))

    @property
    def _note_below(self) -> int:
        """The note speaks of sizes below this: 2 for the specialised sizes 0 and 1,
        else the range's minimum (sizes excluded while capturing)."""
        return 2 if self.note.startswith(" (0/1 ") else self.min

    def _outside(self, got: str, got_shape: str, note: str) -> Parts:
        hi = "inf" if self.max is None else str(self.max)
        return [
            f"{describe_source(self.source)}: dimension {self.dim} must be in [{self.min}, {hi}] "
            "(the range recorded at capture), got ", got, note, "; shape ", got_shape,
        ]  # fmt: skip

    def python(self, read: Reader) -> list[str] | None:
        x = read(self.source)
        if x is None:
            return None
        size = f"{x}.shape[{self.dim}]"
        cond = f"{size} < {self.min}" + ("" if self.max is None else f" or {size} > {self.max}")
        if not self.note:
            msg = self._outside(Code(size), Code(f"tuple({x}.shape)"), "")
            return [f"{self.symbol} = {size}", f"if {cond}:", "    " + self.raise_line(msg)]
        note = f"{self.symbol}_note"
        msg = self._outside(Code(size), Code(f"tuple({x}.shape)"), Code(note))
        return [
            f"{self.symbol} = {size}",
            f"if {cond}:",
            f"    {note} = {self.note!r} if {self.symbol} < {self._note_below} else ''",
            "    " + self.raise_line(msg),
        ]

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        e = data["expected"]
        return cls(
            data["phase"], data["expr"], data["subject"], int(e["dim"]), e["symbol"],
            int(e["min"]), e["max"], e.get("note", ""),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ShapeGuard(Guard):
    """A relation between symbolic sizes the compiled code relies on (``Ne(s0, 1)``)."""

    expression: str = ""
    kind: ClassVar[str] = "shape"

    def problem(self, call: Call) -> str | None:
        symbols = sorted(_symbols(self.expression))
        if not symbols or not set(symbols) <= set(call.sizes):
            return None
        if _sympy_holds(self.expression, {s: call.sizes[s] for s in symbols}) is False:
            return render(self._fails({s: str(call.sizes[s]) for s in symbols}))
        return None

    def _fails(self, sizes: Mapping[str, str]) -> Parts:
        parts: Parts = [f"shape guard {self.expr} does not hold for this call ("]
        for i, (name, got) in enumerate(sizes.items()):
            parts += [f"{', ' if i else ''}{name}=", got]
        return [*parts, ")"]

    def python(self, read: Reader) -> list[str] | None:
        code = _sympy_python(self.expression)
        if code is None:
            return None
        msg = self._fails({s: Code(s) for s in sorted(_symbols(self.expression))})
        return [f"if not ({code}):", "    " + self.raise_line(msg)]

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        if isinstance(data.get("expected"), dict):
            return RangeGuard._from_untyped(data)
        return cls(data["phase"], data["expr"], str(data.get("expected") or data["expr"]))


def _symbols(expression: str) -> set[str]:
    return set(_SYMBOL.findall(expression))


def _sympy_holds(expression: str, values: dict[str, int]) -> bool | None:
    # sympy is imported only to explain a failure (a load never needs it).
    import sympy

    try:
        syms = {s: sympy.Symbol(s, integer=True) for s in values}
        result = sympy.sympify(expression, locals=syms).subs(
            {syms[s]: v for s, v in values.items()}
        )
    except Exception:
        return None
    if result in (sympy.true, True):
        return True
    if result in (sympy.false, False):
        return False
    return None


def _sympy_python(expression: str) -> str | None:
    import sympy
    from sympy.printing.pycode import pycode

    try:
        syms = {s: sympy.Symbol(s, integer=True) for s in _symbols(expression)}
        code = pycode(sympy.sympify(expression, locals=syms))
    except Exception:
        return None
    return None if "math." in code or "numpy" in code or "mpmath" in code else code
