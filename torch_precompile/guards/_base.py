"""The base of every guard: its stage, its statement, its check, its message, its Python form.

Every consumer uses these objects: the runtime's diagnosis of a failed call,
``inspect`` and ``as_text()`` (``expr``), the file's header (``to_json``), and
``to_python()`` (``python``). A check returns the *problem* (the message
without the stage) or None; the stage is appended once, by :meth:`Guard.error`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .._errors import GuardError
from ._identity import Identity
from ._python import Parts, fstring
from ._source import MISSING, Source, describe_source

PHASES = ("dynamo", "aot_autograd", "inductor")


@dataclasses.dataclass
class Call:
    """What a check may read of one call: the frame's locals, grad mode, symbolic sizes."""

    f_locals: dict[str, Any]
    grad_enabled: bool
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)


# An expression reading a source in generated code, or None when it has no plain form.
Reader = Callable[[str], "str | None"]


@dataclasses.dataclass(frozen=True)
class Guard:
    """One assumption of an artifact: the stage that added it and a readable statement.

    ``kind`` names the family (``tensor``, ``value``, ``global``, ``shape``,
    ``range``, ``identity``, ``system``, ``autograd``, ``requires_grad``,
    ``hooks``, ``index``, ``structure``, ``dropped``); each family is a
    subclass holding its data typed.
    """

    phase: str
    expr: str
    kind: ClassVar[str] = "note"

    def __str__(self) -> str:
        return f"[{self.phase}] {self.expr}"

    @property
    def subject(self) -> str | None:
        """The source this guard reads (``L['x']``), if it reads one."""
        return None

    def problem(self, call: Call) -> str | None:
        """Why ``call`` breaks this guard, in words (None: it holds or is not checked here)."""
        return None

    def error(self, call: Call) -> GuardError | None:
        """The GuardError for ``call`` (its problem, tagged with the stage), or None."""
        problem = self.problem(call)
        return GuardError(f"{problem} [{self.phase}]") if problem else None

    def python(self, read: Reader) -> list[str] | None:
        """Plain-Python lines raising the same GuardError, or None (not checked per call)."""
        return None

    def missing_message(self) -> str:
        """The GuardError's message when the value this guard reads is missing."""
        what = describe_source(self.subject or "")
        return f"{what}: expected a tensor, but it is missing [{self.phase}]"

    def raise_line(self, parts: Parts) -> str:
        """``raise GuardError(f"...")`` with this guard's stage, for generated code."""
        return f"raise GuardError({fstring([*parts, f' [{self.phase}]'])})"

    def to_json(self) -> dict[str, Any]:
        data = {"phase": self.phase, "kind": self.kind, "expr": self.expr}
        for f in dataclasses.fields(self):
            if f.name not in data:
                data[f.name] = _jsonable(getattr(self, f.name))
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any], kinds: Mapping[str, type[Guard]] | None = None) -> Guard:
        """A guard from its JSON entry (typed, or the untyped entries of format-1 files).
        ``kinds``: :func:`guard_kinds`, found once where many entries are read."""
        cls = (guard_kinds() if kinds is None else kinds).get(str(data.get("kind")), Note)
        if "expected" in data or "subject" in data:
            return cls._from_untyped(data)
        return cls._from_typed(data)

    @classmethod
    def _from_typed(cls, data: Mapping[str, Any]) -> Guard:
        fields = _field_names(cls)
        return cls(**{k: _frozen(v) for k, v in data.items() if k in fields})

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return Note(data["phase"], data["expr"], str(data.get("kind", "note")))


def guard_kinds() -> dict[str, type[Guard]]:
    """Every guard class by its ``kind`` (the subclasses defined in this package)."""
    found: dict[str, type[Guard]] = {}
    todo = list(Guard.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls is not Note:
            found[cls.kind] = cls
    return found


@functools.cache
def _field_names(cls: type[Guard]) -> frozenset[str]:
    """A guard class's dataclass fields (a class's fields never change)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Identity):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _frozen(value: Any) -> Any:
    """JSON lists back to the tuples the frozen guards hold."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class Note(Guard):
    """An entry that states what the artifact assumes without a check of its own."""

    note_kind: str = "note"

    @classmethod
    def _from_typed(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], str(data.get("kind", "note")))

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.note_kind

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "kind": self.kind, "expr": self.expr}


def _resolve(source: str, call: Call) -> Any:
    parsed = Source.parse(source)
    return parsed.resolve(call.f_locals) if parsed is not None else MISSING


def note(phase: str, kind: str, expr: str) -> Note:
    """An entry that only states an assumption (``requires_grad``, ``structure``)."""
    return Note(phase, expr, kind)
