"""The one error type a request meets: an HTTP status and OpenAI's ``{"error": {...}}`` body."""

from __future__ import annotations

from typing import Any

# OpenAI's ``code`` for the statuses that have one.
_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 503: "overloaded"}


class ApiError(Exception):
    """A request the server refuses: the status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        code = _CODES.get(self.status)
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}
        }
