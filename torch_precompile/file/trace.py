"""What a load did, for benchmarks and tests: file reads, checksums and load phases.

Off unless asked (one list lookup per event). Inside :func:`recording`, the
file reader records each header read, section read and checksum
(``kind``, section name, bytes, seconds) and ``Precompile.load`` each phase
(``"phase"``, its name, 0, seconds)::

    with recording() as trace:
        Precompile.load(path)
    trace.count("hash", "compiled")  # 0: the lean load never touches it

Standard library only: ``torch-precompile inspect`` uses it without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

__all__ = ["Event", "Trace", "phase", "record", "recording"]


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing a load did: ``kind`` is ``header``, ``read``, ``hash`` or ``phase``."""

    kind: str
    name: str
    nbytes: int
    seconds: float


@dataclasses.dataclass
class Trace:
    """The events recorded inside one :func:`recording`, in order."""

    events: list[Event] = dataclasses.field(default_factory=list)

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def count(self, kind: str, name: str) -> int:
        """How many ``kind`` events named ``name`` (e.g. reads of one section)."""
        return sum(1 for e in self.events if e.kind == kind and e.name == name)

    def names(self, kind: str) -> set[str]:
        return {e.name for e in self.events if e.kind == kind}


_ACTIVE: list[Trace] = []


@contextlib.contextmanager
def recording() -> Iterator[Trace]:
    """Record every event of this process until the block exits (nestable)."""
    trace = Trace()
    _ACTIVE.append(trace)
    try:
        yield trace
    finally:
        _ACTIVE.remove(trace)


def record(kind: str, name: str, nbytes: int, seconds: float) -> None:
    """Add an event to every active recording (nothing when none is)."""
    if _ACTIVE:
        event = Event(kind, name, nbytes, seconds)
        for trace in _ACTIVE:
            trace.events.append(event)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as load phase ``name`` (phases may nest: each is its own total)."""
    if not _ACTIVE:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        record("phase", name, 0, time.perf_counter() - start)
