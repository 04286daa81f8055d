"""Who gets in: the API key (``serve --api-key``), and nobody once the server drains.

An ASGI middleware in front of every route. With a key, each request but
``/health`` must carry ``Authorization: Bearer KEY``, or it is a 401 with
OpenAI's error body (``code`` ``invalid_api_key``), as vLLM's ``--api-key``.
While the server drains (SIGTERM), every new request, ``/health`` included, is
a 503, so a load balancer sends no more; the requests already in are counted
(``inflight``) so the drain knows when they have all been answered.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from .errors import ApiError

_OPEN = frozenset({"/health"})


class Admission:
    """The middleware; ``draining`` is set from the drain's thread, read on the loop."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None  # an empty key: none
        self.draining = False
        self.inflight = 0  # requests admitted and not yet answered (changed on the loop)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self._refusal(scope)
        if refused is not None:
            await _send(send, refused)
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1

    def _refusal(self, scope: dict[str, Any]) -> ApiError | None:
        if self.draining:
            return ApiError(
                503, "the server is shutting down: retry on another", kind="server_error"
            )
        if self.key is None or scope["path"] in _OPEN:
            return None
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not given:
            return ApiError(
                401, "no API key: send the header 'Authorization: Bearer KEY' (serve --api-key)"
            )
        if not hmac.compare_digest(given.strip(), self.key):
            return ApiError(401, "the API key is not this server's")
        return None


async def _send(send: Any, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
