"""The engine as the HTTP side uses it: a request's :class:`Job` in, the engine's
typed events out.

The scheduling, the model's steps and the output stage are the engine's
(``torch_precompile/engine``); this module adds what belongs to the API: the
model's own sampling settings as defaults for the fields a request leaves out
(as vLLM's, which reads the same generation_config) and a :class:`Job` as the
engine's :class:`~torch_precompile.engine.requests.Request`. The engine's errors
(``RequestError``, ``EngineBusy``) become OpenAI's statuses in ``app.py``.
"""

from __future__ import annotations

from typing import Any

from ..engine.errors import NotServable
from ..engine.requests import Request
from ..engine.runner import Loaded
from ..engine.runs import Run, Sink
from ..engine.scheduler import Scheduler
from ..engine.text import Tokens
from .protocol import Job

__all__ = ["Engine", "NotServable", "request_of"]


def request_of(job: Job) -> Request:
    """The engine's request for a job read from an API request."""
    return Request(
        prompt=tuple(job.prompt),
        max_tokens=job.max_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        top_k=job.top_k,
        min_p=job.min_p,
        seed=job.seed,
        logit_bias=tuple(job.logit_bias.items()),
        presence_penalty=job.presence_penalty,
        frequency_penalty=job.frequency_penalty,
        repetition_penalty=job.repetition_penalty,
        stop=job.stop,
        stop_token_ids=job.stop_token_ids,
        ignore_eos=job.ignore_eos,
        logprobs=job.logprobs,
        n=job.n,
        prompt_logprobs=_prompt_top(job),
        constraint=job.constraint,
    )


def _prompt_top(job: Job) -> int | None:
    """How many alternatives each prompt token needs: echo's logprobs, vLLM's
    prompt_logprobs, the more of the two (echo alone with no new token: 0)."""
    asked = [t for t in (job.prompt_logprobs, job.logprobs if job.echo else None) if t is not None]
    if asked:
        return max(asked)
    return 0 if job.echo and job.max_tokens == 0 else None


class Engine(Scheduler):
    """The scheduler over a generator file, taking :class:`Job`s (see the module docstring)."""

    def __init__(
        self, generator: Loaded, *, max_queue: int, tokenizer: Any = None, **options: Any
    ) -> None:
        super().__init__(generator, max_queue=max_queue, tokenizer=tokenizer, **options)
        self.tokens = Tokens(tokenizer, self.spec)  # text in and out, for the HTTP side
        # The model's own sampling settings and max_new_tokens, for a request that leaves
        # them out.
        self.defaults = {k: v for k, v in self.spec.sampling if k != "do_sample"}
        own = dict(self.spec.lengths).get("max_new_tokens")
        if own is not None:
            self.defaults["max_tokens"] = own

    def open(self, job: Job, sink: Sink) -> Run:
        """Queue a job, its events to ``sink`` (the engine's errors as
        :meth:`Scheduler.submit` raises them; the app maps them to statuses)."""
        return super().submit(request_of(job), sink, with_ids=job.return_token_ids)
