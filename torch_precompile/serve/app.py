"""The HTTP side: OpenAI's routes over the engine, on Starlette (ASGI) served by uvicorn.

Handlers run on the event loop and only read requests, queue jobs and write
what the engine thread sends back (through ``call_soon_threadsafe`` into a
per-request queue). A streaming response that loses its client is cancelled
by Starlette, and its ``finally`` frees the slot; a whole response watches
for the client's disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine
from .protocol import ApiError, Job, choice, envelope, models_list, read_job, usage


def _error(exc: Exception) -> JSONResponse:
    if isinstance(exc, ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), kind=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)
    err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
    return JSONResponse(err.body(), status_code=500)


def build_app(
    engine: Engine,
    *,
    name: str,
    encode: Callable[[str], list[int]],
    render: Callable[[list[dict[str, Any]]], list[int]],
) -> Starlette:
    """The ASGI app serving ``engine`` under the model name ``name``."""
    created = int(time.time())
    max_length = engine.spec.max_length

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **engine.load()})

    async def models(request: Request) -> Response:
        return JSONResponse(models_list(name, created, max_length))

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        job = read_job(
            body,
            chat=chat,
            served=name,
            max_length=max_length,
            encode=encode,
            render=render,
            defaults=engine.defaults,
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        run = engine.submit(job, _sink(loop, events))
        if job.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                _stream(engine, run, job, events), media_type="text/event-stream", headers=headers
            )
        return await _whole(request, engine, run, job, events)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    handlers = {Exception: _handler, HTTPException: _handler, ApiError: _handler}
    return Starlette(routes=routes, exception_handlers=handlers)


def _sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Any]) -> Callable[[Any], None]:
    """The engine thread's way into this request's queue (a no-op once the loop is closed)."""

    def put(event: Any) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the server is shutting down
            pass

    return put


async def _handler(request: Request, exc: Exception) -> Response:
    return _error(exc)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(
    engine: Engine, run: Any, job: Job, events: asyncio.Queue[dict[str, Any]]
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finish, usage if asked, ``[DONE]``."""
    try:
        offset = 0
        if job.chat:
            first = envelope(job, [choice(job, "", [], None, delta=True)], chunk=True)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        while True:
            event = await events.get()
            if "error" in event:
                yield _sse(ApiError(500, event["error"], kind="server_error").body())
                break
            if event["text"] or event["entries"] or event["finish"] or "ids" in event:
                piece = choice(
                    job, event["text"], event["entries"], event["finish"], delta=True, offset=offset
                )
                if "ids" in event:  # asked for, or a file without a tokenizer
                    piece["token_ids"] = event["ids"]
                yield _sse(envelope(job, [piece], chunk=True))
            offset += len(event["text"])
            if event["finish"]:
                if job.include_usage:
                    yield _sse(
                        {**envelope(job, [], chunk=True), "usage": usage(job, event["tokens"])}
                    )
                break
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(run)  # a client gone mid-stream: the slot frees at once


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(
    request: Request, engine: Engine, run: Any, job: Job, events: asyncio.Queue[dict[str, Any]]
) -> Response:
    """The whole answer once the run ends; a client that leaves first frees its slot."""
    gone = asyncio.ensure_future(_disconnected(request))
    text, entries, ids = "", [], []
    try:
        while True:
            got = asyncio.ensure_future(events.get())
            await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                return Response(status_code=499)  # nobody to read it
            event = got.result()
            if "error" in event:
                raise ApiError(500, event["error"], kind="server_error")
            text += event["text"]
            entries += event["entries"]
            ids += event.get("ids", [])
            if event["finish"]:
                whole = choice(job, text, entries, event["finish"], delta=False)
                if ids:  # asked for, or a file without a tokenizer
                    whole["token_ids"] = ids
                body = envelope(job, [whole], chunk=False)
                body["usage"] = usage(job, event["tokens"])
                return JSONResponse(body)
    finally:
        gone.cancel()
        engine.cancel(run)
