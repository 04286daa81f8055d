"""What the scheduler holds of a request: its run (each choice's stream, its sink),
each choice in its slot, and the checks a request meets before it queues."""

from __future__ import annotations

from collections.abc import Callable

from .batch import Batch
from .errors import RequestError
from .output import Stream
from .prefix import Filling
from .requests import Event, Request

Sink = Callable[[Event], None]


class Run:
    """A request in the scheduler: each choice's output stream, and where its events go."""

    def __init__(self, streams: list[Stream], sink: Sink) -> None:
        self.streams, self.sink = streams, sink
        self.cancelled = False

    @property
    def request(self) -> Request:
        return self.streams[0].request

    @property
    def width(self) -> int:
        """The slots the run takes: one a choice."""
        return len(self.streams)


class Choice:
    """One choice of a run, in its slot (``filling``: its prompt's prefill, under way)."""

    def __init__(self, run: Run | Batch, stream: Stream | Batch) -> None:
        self.run, self.stream = run, stream
        self.filling: Filling | None = None


def check(request: Request, vocab: int, slots: int) -> None:
    """A :class:`RequestError` naming the field for what the scheduler cannot run."""
    named = (request.prompt, [t for t, _ in request.logit_bias], request.stop_token_ids)
    for param, ids in zip(("prompt", "logit_bias", "stop_token_ids"), named):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is past the vocabulary of {vocab}", param=param)
    if not 1 <= request.n <= slots:
        raise RequestError(
            f"'n' must be 1 to {slots}, got {request.n}: each choice takes a slot "
            f"(the file's max_batch={slots})",
            param="n",
        )
    if request.max_tokens < (request.prompt_logprobs is None):
        raise RequestError(
            f"'max_tokens' must be 1 or more (0 with prompt logprobs), got {request.max_tokens}",
            param="max_tokens",
        )
    constraints = request.constraint
    if isinstance(constraints, tuple) and len(constraints) != request.n:
        raise RequestError(f"{len(constraints)} constraints for n={request.n}", param="n")
    if constraints is not None and not isinstance(constraints, tuple) and request.n > 1:
        raise RequestError("a constraint keeps one choice's state: give one per choice", param="n")
