"""The HTTP side: OpenAI's routes over the engine, on Starlette (ASGI) served by uvicorn.

Handlers run on the event loop and only read requests, queue jobs and write
what the engine thread sends back (through ``call_soon_threadsafe`` into a
per-request queue). A request's body is read on the loop, up to the size cap
(``body.py``); parsing, checking, chat rendering and tokenizing run on a worker
thread, so a large request delays no other's next token. A streaming response
that loses its client is cancelled by Starlette, and its ``finally`` frees the
slot; a whole response watches for the client's disconnect while it waits.

Beside OpenAI's routes: ``/tokenize``, ``/detokenize``, ``/version`` and
``/metrics`` (``operations.py``); in front of them all, the API key and the drain
(``admission.py``). Every route runs inside :func:`_guarded`: a refusal is its
``ApiError``; a client gone before its body was sent is no error; anything else
is one log line with a request id (the same id in the 500's message), not a
traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.errors import EngineBusy, EngineError
from ..engine.requests import Event
from ..engine.text import Tokens
from .admission import Admission
from .answers import Run, stream, whole
from .body import ClientGone, parse_json, read_body
from .engine import Engine
from .errors import unexpected
from .metrics import Metrics
from .operations import Operations
from .prompts import prompt_batch
from .protocol import ApiError, Job, models_list, read_job
from .structured import Grammars

log = logging.getLogger("torch_precompile")

# What vLLM's and nginx's defaults leave room for, sized to prompts: a prompt of
# 128k tokens is about 1 MB of JSON as token ids and 0.5-1.2 MB as text (English to
# escaped CJK). 4 MiB is 3x that, and bounds what one request holds (its JSON parse
# held the GIL 0.1 s per 4 MB of token ids here).
MAX_REQUEST_BYTES = 4 * 2**20
# Workers that parse and tokenize requests: beside the engine's thread and the loop's,
# on a 2-core machine two keep a large request from queueing the small ones.
_WORKERS = 2

Handler = Callable[[Request], Awaitable[Response]]


def _api_error(exc: EngineError) -> ApiError:
    """The engine's refusal as OpenAI's: 400 naming the field, 503 when busy."""
    if isinstance(exc, EngineBusy):
        return ApiError(503, str(exc), kind="server_overloaded")
    return ApiError(400, str(exc), param=getattr(exc, "param", None))


def _error(exc: Exception) -> JSONResponse:
    if isinstance(exc, EngineError):
        exc = _api_error(exc)
    if isinstance(exc, ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), kind=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)
    err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
    return JSONResponse(err.body(), status_code=500)


def _guarded(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except (ApiError, EngineError) as exc:
            return _error(exc)
        except ClientGone:  # nobody to answer: not the server's fault, not logged as one
            log.debug("serve: a client left before sending its whole request")
            return Response(status_code=400)
        except Exception as exc:
            return _error(unexpected(exc, f"{request.method} {request.url.path}"))

    return run


class Completions:
    """OpenAI's generating routes, ``/v1/completions`` and ``/v1/chat/completions``:
    a request's body read into jobs off the loop, each job opened in the engine, its
    events written back as a stream or one answer."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str,
        tokens: Tokens,
        metrics: Metrics,
        off_loop: Callable[[Callable[[], Any]], Awaitable[Any]],
        max_request_bytes: int,
        grammars: Grammars | None,
        tool_parser: str | None,
    ) -> None:
        self.engine, self.name, self.tokens, self.metrics = engine, name, tokens, metrics
        self.off_loop, self.max_request_bytes = off_loop, max_request_bytes
        self.grammars, self.tool_parser = grammars, tool_parser

    def jobs(self, raw: bytes, chat: bool) -> list[Job]:
        """The request's jobs: one, or a completion's one a prompt of its list."""
        body = parse_json(raw)
        bodies = [body] if chat or not isinstance(body, dict) else prompt_batch(body)
        return [
            read_job(
                one,
                chat=chat,
                served=self.name,
                max_length=self.engine.spec.max_length,
                encode=self.tokens.encode,
                render=self.tokens.render,
                defaults=self.engine.defaults,
                grammars=self.grammars,
                tool_parser=self.tool_parser,
            )
            for one in bodies
        ]

    async def answer(self, request: Request, chat: bool) -> Response:
        """The handler: the body read, its jobs opened, the answer written."""
        began = time.perf_counter()
        raw = await read_body(request, self.max_request_bytes)
        jobs = await self.off_loop(lambda: self.jobs(raw, chat))
        loop = asyncio.get_running_loop()
        runs: list[Run] = []
        try:
            for job in jobs:
                events: asyncio.Queue[Event] = asyncio.Queue()
                tracker = self.metrics.track(len(job.prompt), began)
                run = self.engine.open(job, _sink(loop, events, tracker.see))
                runs.append((job, events, functools.partial(_ended, self.engine, run, tracker)))
        except BaseException:  # a full queue: the prompts already in leave it
            for _, _, ended in runs:
                ended()
            raise
        if jobs[0].stream:  # one job: prompt_batch refuses a list of prompts streamed
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            job, events, ended = runs[0]
            return StreamingResponse(
                stream(ended, job, events, self.tokens.decode),
                media_type="text/event-stream",
                headers=headers,
            )
        return await whole(request, runs, self.tokens.decode)

    async def completion(self, request: Request) -> Response:
        return await self.answer(request, chat=False)

    async def chat_completion(self, request: Request) -> Response:
        return await self.answer(request, chat=True)


def build_app(
    engine: Engine,
    *,
    name: str,
    tokens: Tokens,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    api_key: str | None = None,
    grammars: Grammars | None = None,
    tool_parser: str | None = None,
) -> Admission:
    """The ASGI app serving ``engine`` under the model name ``name``, behind its
    :class:`Admission` (the API key, the drain); ``grammars`` and ``tool_parser``
    as :func:`read_job` takes them."""
    created = int(time.time())
    max_length = engine.spec.max_length
    workers = concurrent.futures.ThreadPoolExecutor(
        _WORKERS, thread_name_prefix="torch-precompile-request"
    )

    async def off_loop(work: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(workers, work)

    metrics = Metrics(engine.load)
    operations = Operations(
        name=name,
        tokens=tokens,
        metrics=metrics,
        off_loop=off_loop,
        max_request_bytes=max_request_bytes,
        vocab=lambda: engine.vocab,
    )
    generating = Completions(
        engine,
        name=name,
        tokens=tokens,
        metrics=metrics,
        off_loop=off_loop,
        max_request_bytes=max_request_bytes,
        grammars=grammars,
        tool_parser=tool_parser,
    )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **engine.load()})

    async def models(request: Request) -> Response:
        return JSONResponse(models_list(name, created, max_length))

    routes = [
        Route("/health", _guarded(health), methods=["GET"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/v1/completions", _guarded(generating.completion), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(generating.chat_completion), methods=["POST"]),
        Route("/tokenize", _guarded(operations.tokenize), methods=["POST"]),
        Route("/detokenize", _guarded(operations.detokenize), methods=["POST"]),
        Route("/version", _guarded(operations.version), methods=["GET"]),
        Route("/metrics", _guarded(operations.prometheus), methods=["GET"]),
    ]
    handlers = {Exception: _handler, HTTPException: _handler, ApiError: _handler}
    return Admission(Starlette(routes=routes, exception_handlers=handlers), api_key)


def _ended(engine: Engine, run: Any, tracker: Any) -> None:
    """A response is over (answered, failed or abandoned): its slot frees at once."""
    engine.cancel(run)
    tracker.close()


def _sink(
    loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Any], see: Callable[[Any], None]
) -> Callable[[Any], None]:
    """The engine thread's way into this request's queue, each event seen by the
    request's metrics on the loop (a no-op once the loop is closed)."""

    def arrive(event: Any) -> None:
        see(event)
        events.put_nowait(event)

    def put(event: Any) -> None:
        try:
            loop.call_soon_threadsafe(arrive, event)
        except RuntimeError:  # the server is shutting down
            pass

    return put


async def _handler(request: Request, exc: Exception) -> Response:
    return _error(exc)
