"""A request's body: read up to a size cap, parsed as JSON.

The body is read as it arrives and never held past ``cap`` bytes: a larger one is a
413. Its rest is still read and dropped (up to ``_DRAIN`` bytes), because a server
that closes a connection with unread bytes in it resets the connection, and the
client's TCP then drops the 413 it had not read yet. A body past ``_DRAIN`` (by its
``Content-Length`` or as it comes) is answered at once and the connection closed.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from .errors import ApiError

_DRAIN = 64 * 2**20


class ClientGone(Exception):
    """The client closed its connection before it had sent the whole body."""


def _too_large(cap: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is past this server's limit of {cap} bytes (serve --max-request-bytes)",
    )


async def read_body(request: Request, cap: int) -> bytes:
    """The body's bytes: a 413 past ``cap``, :class:`ClientGone` if the client left."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > _DRAIN:
        raise _too_large(cap)
    kept: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= cap:
                kept.append(chunk)
            elif size > _DRAIN:
                break
    except ClientDisconnect:
        raise ClientGone() from None
    if size > cap:
        raise _too_large(cap)
    return b"".join(kept)


def parse_json(raw: bytes) -> Any:
    """The body as JSON: a 400 for bytes that are not JSON or nest past Python's
    recursion limit (the decoder's RecursionError, 200,000 ``[`` deep, was a 500)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deep to read") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
