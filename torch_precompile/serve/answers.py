"""A run's answer over HTTP: server-sent events as its events come, or the whole body
once every choice has finished (OpenAI's and vLLM's shapes, ``protocol.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.requests import Delta, Event, Failed, TokenLogprob
from .errors import unexpected
from .protocol import ApiError, Job, choice, envelope, usage
from .scoring import echoed, prompt_logprobs
from .tool_calls import stream_choices, whole_choice

Run = tuple[Job, "asyncio.Queue[Event]", Callable[[], None]]  # a job, its events, its end


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(
    ended: Callable[[], None],
    job: Job,
    events: asyncio.Queue[Event],
    decode: Callable[[list[int]], str],
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finish, usage if asked, ``[DONE]``."""
    try:
        async for chunk in _chunks(job, events, decode):
            yield chunk
    except Exception as exc:  # the headers are sent: the error is the stream's last event
        yield _sse(unexpected(exc, "a stream").body())
    finally:
        ended()  # a client gone mid-stream: the slot frees at once


async def _chunks(
    job: Job, events: asyncio.Queue[Event], decode: Callable[[list[int]], str]
) -> AsyncIterator[str]:
    """Each choice's pieces as they come (``index`` tells them apart), its prompt's
    (``echo``, ``prompt_logprobs``) first, as vLLM streams them; the usage once every
    choice has finished."""
    offsets, used = [0] * job.n, list[int | None]([None] * job.n)
    started = [False] * job.n
    calls = [job.tools.stream() if job.tools is not None else None for _ in range(job.n)]
    if job.chat:
        for i in range(job.n):
            first = envelope(job, [choice(job, "", (), None, delta=True, index=i)], chunk=True)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
    while None in used:
        event = await events.get()
        if isinstance(event, Failed):
            yield _sse(ApiError(500, event.message, kind="server_error").body())
            break
        i, finish = event.index, None if event.finish is None else event.finish.reason
        first, started[i] = not started[i], True
        if first and (job.echo or job.prompt_logprobs is not None):
            piece = choice(job, "", (), None, delta=True, index=i)
            if job.echo:
                echoed(job, piece, event.prompt_logprobs, decode)
                offsets[i] += len(piece["text"])
            if job.prompt_logprobs is not None:
                top = job.prompt_logprobs
                piece["prompt_logprobs"] = prompt_logprobs(event.prompt_logprobs, top)
            yield _sse(envelope(job, [piece], chunk=True))
        if event.text or event.logprobs or finish or event.token_ids:
            piece = choice(
                job, event.text, event.logprobs, finish, delta=True, offset=offsets[i], index=i
            )
            if event.token_ids:  # asked for, or a file without a tokenizer
                piece["token_ids"] = list(event.token_ids)
            for one in [piece] if calls[i] is None else stream_choices(calls[i], piece):
                yield _sse(envelope(job, [one], chunk=True))
        offsets[i] += len(event.text)
        if event.finish is not None:
            used[i] = event.tokens
            if None not in used and job.include_usage:
                cached = event.finish.usage.cached_tokens
                counts = usage(len(job.prompt), sum(used), cached)  # type: ignore[arg-type]
                yield _sse({**envelope(job, [], chunk=True), "usage": counts})
    yield "data: [DONE]\n\n"


class _Gathered:
    """One choice's events, gathered into its whole answer."""

    def __init__(self) -> None:
        self.text, self.tokens, self.finish, self.cached = "", 0, None, 0
        self.entries: list[TokenLogprob] = []
        self.prompt: tuple[TokenLogprob, ...] = ()
        self.ids: list[int] = []

    def add(self, event: Delta) -> None:
        self.text += event.text
        self.entries += event.logprobs
        self.ids += event.token_ids
        self.tokens = event.tokens
        self.prompt = event.prompt_logprobs or self.prompt
        if event.finish is not None:
            self.finish, self.cached = event.finish.reason, event.finish.usage.cached_tokens

    def choice(self, job: Job, index: int, decode: Callable[[list[int]], str]) -> dict[str, Any]:
        whole = choice(job, self.text, self.entries, self.finish, delta=False, index=index)
        calls = job.tools.stream() if job.tools is not None else None
        whole = whole if calls is None else whole_choice(calls, whole)
        if self.ids:  # asked for, or a file without a tokenizer
            whole["token_ids"] = self.ids
        if job.echo:
            echoed(job, whole, self.prompt, decode)
        if job.prompt_logprobs is not None:
            whole["prompt_logprobs"] = prompt_logprobs(self.prompt, job.prompt_logprobs)
        return whole


def _delta(event: Event) -> Delta:
    """The event, or the 500 of a step that failed."""
    if isinstance(event, Failed):
        raise ApiError(500, event.message, kind="server_error")
    return event


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(request: Request, runs: list[Run], decode: Callable[[list[int]], str]) -> Response:
    """The whole answer once every choice of every prompt ends (prompt ``i``'s choice
    ``j`` at index ``i * n + j``, as OpenAI's); a client that leaves first frees the
    slots."""
    gone = asyncio.ensure_future(_disconnected(request))
    answers: list[dict[str, Any]] = []
    counts = [0, 0, 0]  # prompt, completion and cached tokens of every prompt
    try:
        for job, events, _ in runs:
            got_all = [_Gathered() for _ in range(job.n)]
            while any(g.finish is None for g in got_all):
                got = asyncio.ensure_future(events.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return Response(status_code=499)  # nobody to read it
                event = _delta(got.result())
                got_all[event.index].add(event)
            answers += [g.choice(job, len(answers) + i, decode) for i, g in enumerate(got_all)]
            used = (len(job.prompt), sum(g.tokens for g in got_all), got_all[0].cached)
            counts = [a + b for a, b in zip(counts, used)]
        body = envelope(runs[0][0], answers, chunk=False)
        body["usage"] = usage(*counts)
        return JSONResponse(body)
    finally:
        gone.cancel()
        for _, _, ended in runs:
            ended()
