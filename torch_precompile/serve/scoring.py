"""A prompt's own logprobs in a whole answer: OpenAI's ``echo`` (the prompt's text and
tokens before each choice's, the first token's logprob ``null``, as lm-eval's
loglikelihood reads them) and vLLM's ``prompt_logprobs``.

The engine teacher-forces the prompt through the decode step for them
(``torch_precompile/engine/output.py``): the file's prefill returns the last
position's logits only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..engine.requests import TokenLogprob
from .protocol import Job


def echoed(
    job: Job,
    whole: dict[str, Any],
    prompt: Sequence[TokenLogprob],
    decode: Callable[[list[int]], str],
) -> None:
    """The prompt before the choice's text, and its tokens before the choice's logprobs."""
    text = job.prompt_text if job.prompt_text is not None else decode(job.prompt)
    whole["text"] = text + whole["text"]
    logprobs = whole.get("logprobs")
    if logprobs is None:
        return
    at, offsets = 0, []
    for e in prompt:
        offsets.append(at)
        at += len(e.token)
    logprobs["tokens"] = [e.token for e in prompt] + logprobs["tokens"]
    logprobs["token_logprobs"] = [e.logprob for e in prompt] + logprobs["token_logprobs"]
    top = [None if e.logprob is None else _alternatives(e, job.logprobs) for e in prompt]
    logprobs["top_logprobs"] = top + logprobs["top_logprobs"]
    logprobs["text_offset"] = offsets + [o + len(text) for o in logprobs["text_offset"]]


def _alternatives(entry: TokenLogprob, top: int | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for token, logprob, _ in entry.top[: top or 0]:
        out.setdefault(token, logprob)
    return out


def prompt_logprobs(prompt: Sequence[TokenLogprob], top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token its id's
    logprob, rank and text, and its ``top`` alternatives' (ranks 1, 2, ...)."""
    out: list[dict[str, Any] | None] = [None]
    for e in prompt[1:]:
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, ((token, logprob, _), tid) in enumerate(zip(e.top[:top], e.top_ids), 1):
            entry.setdefault(str(tid), {"logprob": logprob, "rank": rank, "decoded_token": token})
        out.append(entry)
    return out
