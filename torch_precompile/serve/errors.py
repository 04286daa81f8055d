"""The one error type a request meets: an HTTP status and OpenAI's ``{"error": {...}}`` body."""

from __future__ import annotations

import logging
import uuid
from typing import Any

log = logging.getLogger("torch_precompile")

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


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def unexpected(exc: BaseException, where: str) -> ApiError:
    """An error nobody expected, logged as one line with an id, as a 500 naming the id."""
    rid = uuid.uuid4().hex[:16]
    log.error("serve: request %s (%s) failed: %s", rid, where, _one_line(exc))
    return ApiError(500, f"internal error (request {rid}): {_one_line(exc)}", kind="server_error")
