"""What the engine refuses, typed: the HTTP layer maps each to a status, a Python
caller catches it as a ``ValueError`` or a ``PrecompileError``."""

from __future__ import annotations

from .._errors import PrecompileError


class EngineError(PrecompileError):
    """Base class of the engine's refusals."""


class RequestError(EngineError, ValueError):
    """A request the engine cannot run as given (``param``: the field at fault)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBusy(EngineError):
    """Every slot is taken and the queue is full: retry later."""


class NotServable(EngineError, ValueError):
    """A generator file the engine cannot batch (built without the slot step)."""
