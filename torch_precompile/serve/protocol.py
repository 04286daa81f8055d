"""OpenAI's request and response shapes: a request read into a :class:`Job`, results written back.

Each field a client may send is checked here, once, with an error that names
it (``ApiError``: the HTTP status and OpenAI's ``{"error": {...}}`` body).
Fields OpenAI has that this server cannot honour (``best_of``) are refused, not
ignored. ``response_format``, ``structured_outputs`` and ``tools`` are read by
``structured.py`` and ``tool_calls.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..engine.requests import TokenLogprob
from .errors import ApiError
from .prompts import chat_messages, completion_prompt
from .structured import Grammars, constraint_of
from .tool_calls import ToolPlan, read_tools

__all__ = ["ApiError", "Job", "choice", "envelope", "models_list", "read_job", "usage"]

log = logging.getLogger("torch_precompile")

# The most logprobs OpenAI's API returns per token (completions; chat allows 20).
_MAX_LOGPROBS, _MAX_TOP_LOGPROBS = 5, 20
# OpenAI's default max_tokens for /v1/completions.
_COMPLETION_DEFAULT = 16
# OpenAI's ranges: presence and frequency penalties, and a logit_bias value.
_MAX_PENALTY, _MAX_BIAS = 2.0, 100.0
# A seed is a signed 64-bit integer, as vLLM's; torch.Generator's manual_seed takes
# -2**63 to 2**64 - 1 and raised OverflowError past it.
_SEEDS = (-(2**63), 2**63 - 1)


@dataclasses.dataclass
class Job:
    """One request as the engine runs it (the prompt already tokens)."""

    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None  # vLLM's extension
    seed: int | None = None
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension (transformers' penalty)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # vLLM's extension
    stream: bool = False
    logprobs: int | None = None  # completions: top-n per token; chat: top_logprobs
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks)
    return_token_ids: bool = False  # vLLM's extension: each choice's new token ids
    n: int = 1  # choices, each its own slot
    echo: bool = False  # completions: the prompt before each choice's text (and logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs, top-n
    prompt_text: str | None = None  # echo: the prompt as sent (None: sent as token ids)
    constraint: Any = None  # the tokens allowed next (engine/constraint.py's; a tuple: n)
    tools: ToolPlan | None = None  # how the answer's tool calls are read (tool_calls.py)
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {names}, got {type(value).__name__}", param=name)
    return value


# Every field a request may carry: read, refused when it cannot be honoured, or without
# effect on the answer (user, metadata, ...). Others are logged, as vLLM's server does.
_KNOWN = frozenset((
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "stream", "stream_options",
    "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "ignore_eos", "return_token_ids", "n", "best_of", "echo", "tools",
    "functions", "suffix", "response_format", "min_tokens", "tool_choice", "function_call",
    "parallel_tool_calls", "user", "metadata", "store", "service_tier", "prompt_logprobs",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
))  # fmt: skip
# Fields that would change the answer in a way this server cannot: refused when set
# (token filters, beam search).
_REFUSED = ("suffix", "allowed_token_ids", "bad_words", "use_beam_search")


def _note_unknown(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _KNOWN - set(_REFUSED))
    if unknown:
        log.warning("serve: request fields this server does not read, ignored: %s", unknown)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if _field(body, "best_of", (int,), 1) != 1:
        raise ApiError(400, "'best_of' is not supported", param="best_of")
    for name in _REFUSED:
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported", param=name)
    if _field(body, "min_tokens", (int,), 0):
        raise ApiError(400, "'min_tokens' is not supported", param="min_tokens")


def read_job(
    body: Any,
    *,
    chat: bool,
    served: str,
    max_length: int,
    encode: Any,
    render: Any,
    defaults: dict[str, Any] | None = None,
    grammars: Grammars | None = None,
    tool_parser: str | None = None,
) -> Job:
    """A request body (parsed JSON) as a :class:`Job`, or an :class:`ApiError`.

    ``encode(text)`` tokenizes a completion prompt; ``render(messages)``
    renders and tokenizes a chat (each raises ``ApiError`` when the file
    cannot: no tokenizer, no template). ``defaults`` are the model's sampling
    settings (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``) and its ``max_new_tokens`` (as ``max_tokens``) for a
    request that leaves them out, as vLLM's: a chat without ``max_tokens`` runs to
    the model's ``max_new_tokens`` (else to the end of the cache), a completion to
    OpenAI's 16. ``grammars`` compiles a request's ``response_format``,
    ``structured_outputs`` or forced tool calls (None: a 400 for them);
    ``tool_parser`` is the format ``tool_choice`` auto reads calls in.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _field(body, "model", (str,))
    if model is None:
        raise ApiError(400, "'model' is required", param="model")
    if model != served:
        raise ApiError(
            404, f"the model '{model}' does not exist: this server serves '{served}'", param="model"
        )
    _note_unknown(body)
    _refuse_unsupported(body)
    plan = read_tools(body, tool_parser, chat=chat)
    if chat:
        prompt = render(chat_messages(body), tools=list(plan.tools) if plan else None)
    else:
        prompt = completion_prompt(body, encode, max_length)
    if not prompt:
        raise ApiError(400, "the prompt is empty: give at least one token", param="prompt")
    room = max_length - len(prompt)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    asked = next((_field(body, n, (int,)) for n in names if body.get(n) is not None), None)
    scored = bool(body.get("echo")) or body.get("prompt_logprobs") is not None
    if asked is not None and asked < (0 if scored else 1):
        raise ApiError(
            400,
            f"'max_tokens' must be 1 or more (0 with echo or prompt_logprobs), got {asked}",
            param="max_tokens",
        )
    own = (defaults or {}).get("max_tokens")  # the model's max_new_tokens
    if not chat:  # OpenAI's default, as vLLM's completions keep it
        default = min(_COMPLETION_DEFAULT, room)
    else:
        default = room if own is None else min(own, room)
    max_tokens = default if asked is None else asked
    if max_tokens > room or room < 1:
        raise ApiError(
            400,
            f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} is past the "
            f"model's max_length={max_length}: shorten the prompt or max_tokens",
            param="max_tokens",
        )
    job = Job(chat=chat, model=model, prompt=prompt, max_tokens=max_tokens, tools=plan)
    job.constraint = constraint_of(body, plan.grammar() if plan else None, grammars)
    _sampling({**(defaults or {}), **{k: v for k, v in body.items() if v is not None}}, job)
    _options(body, job)
    if job.constraint is not None and job.n > 1:  # each choice its own state, off the loop
        job.constraint = (job.constraint, *(job.constraint.copy() for _ in range(job.n - 1)))
    return job


def _sampling(body: dict[str, Any], job: Job) -> None:
    job.temperature = float(_field(body, "temperature", (int, float), 1.0))
    if not 0 <= job.temperature <= 2:
        raise ApiError(400, "'temperature' must be in [0, 2]", param="temperature")
    top_p = _field(body, "top_p", (int, float))
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, "'top_p' must be in (0, 1]", param="top_p")
    job.top_p = None if top_p is None else float(top_p)
    top_k = _field(body, "top_k", (int,))
    if top_k is not None and top_k < -1:
        raise ApiError(400, "'top_k' must be -1, 0 (off) or a positive number", param="top_k")
    job.top_k = top_k if top_k and top_k > 0 else None
    min_p = _field(body, "min_p", (int, float))
    if min_p is not None and not 0 <= min_p <= 1:
        raise ApiError(400, "'min_p' must be in [0, 1]", param="min_p")
    job.min_p = None if min_p is None else float(min_p)
    job.seed = _field(body, "seed", (int,))
    if job.seed is not None and not _SEEDS[0] <= job.seed <= _SEEDS[1]:
        raise ApiError(
            400,
            f"'seed' must be in [-2**63, 2**63 - 1] (a 64-bit integer), got {job.seed}",
            param="seed",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = float(_field(body, name, (int, float), 0.0))
        if not -_MAX_PENALTY <= value <= _MAX_PENALTY:
            raise ApiError(400, f"'{name}' must be in [-2, 2], got {value}", param=name)
        setattr(job, name, value)
    job.repetition_penalty = float(_field(body, "repetition_penalty", (int, float), 1.0))
    if not 0 < job.repetition_penalty < float("inf"):
        raise ApiError(400, "'repetition_penalty' must be above 0", param="repetition_penalty")
    job.logit_bias = _logit_bias(_field(body, "logit_bias", (dict,), {}))


def _logit_bias(bias: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as strings) to a number in [-100, 100]."""
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ApiError(
                400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias"
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and -_MAX_BIAS <= value <= _MAX_BIAS):
            message = f"'logit_bias' values must be numbers in [-100, 100], got {value!r}"
            raise ApiError(400, message, param="logit_bias")
        out[int(key)] = float(value)
    return out


def _options(body: dict[str, Any], job: Job) -> None:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", param="stop")
    job.stop = tuple(stop or ())
    ids = _field(body, "stop_token_ids", (list,), [])
    if not all(type(t) is int and t >= 0 for t in ids):
        raise ApiError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    job.stop_token_ids = frozenset(ids)
    job.stream = bool(_field(body, "stream", (bool,), False))
    job.ignore_eos = bool(_field(body, "ignore_eos", (bool,), False))
    job.return_token_ids = bool(_field(body, "return_token_ids", (bool,), False))
    job.n = _field(body, "n", (int,), 1)
    _scoring(body, job)
    options = _field(body, "stream_options", (dict,), {})
    job.include_usage = bool(options.get("include_usage", False))
    if job.chat:
        top = _field(body, "top_logprobs", (int,))
        if _field(body, "logprobs", (bool,), False):
            job.logprobs = top or 0
        if top is not None and not 0 <= top <= _MAX_TOP_LOGPROBS:
            raise ApiError(
                400, f"'top_logprobs' must be in 0..{_MAX_TOP_LOGPROBS}", param="top_logprobs"
            )
    else:
        job.logprobs = _field(body, "logprobs", (int,))
        if job.logprobs is not None and not 0 <= job.logprobs <= _MAX_LOGPROBS:
            raise ApiError(400, f"'logprobs' must be in 0..{_MAX_LOGPROBS}", param="logprobs")


def _scoring(body: dict[str, Any], job: Job) -> None:
    """``echo`` (completions) and ``prompt_logprobs``."""
    job.echo = bool(_field(body, "echo", (bool,), False))
    if job.echo and job.chat:
        raise ApiError(400, "'echo' is for /v1/completions", param="echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    job.prompt_text = prompt if job.echo and isinstance(prompt, str) else None
    job.prompt_logprobs = _field(body, "prompt_logprobs", (int,))
    top = job.prompt_logprobs
    if top is not None and not 0 <= top <= _MAX_TOP_LOGPROBS:
        message = f"'prompt_logprobs' must be in 0..{_MAX_TOP_LOGPROBS}"
        raise ApiError(400, message, param="prompt_logprobs")


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage: ``cached`` of the prompt's tokens were a slot's kept entries."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _logprobs(job: Job, entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any] | None:
    """Each token's logprob (and its top alternatives) as OpenAI writes them."""
    if job.logprobs is None:
        return None
    if job.chat:
        content = [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.bytes),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in e.top
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else _first_of_each(e.top[: job.logprobs]) for e in entries
        ],
        "text_offset": offsets,
    }


def _first_of_each(top: Sequence[tuple[str, float, bytes]]) -> dict[str, float]:
    """OpenAI's dict of alternatives: two tokens that decode alike keep the likelier."""
    out: dict[str, float] = {}
    for token, logprob, _ in top:
        out.setdefault(token, logprob)
    return out


def choice(
    job: Job,
    text: str,
    entries: Sequence[TokenLogprob],
    finish: str | None,
    *,
    delta: bool,
    offset: int = 0,
    index: int = 0,
) -> dict[str, Any]:
    """One choice: a whole answer, or (``delta``) a stream chunk's piece of one."""
    out: dict[str, Any] = {
        "index": index,
        "finish_reason": finish,
        "logprobs": _logprobs(job, entries, offset),
    }
    if not job.chat:
        out["text"] = text
    elif delta:
        out["delta"] = {"content": text}
    else:
        out["message"] = {"role": "assistant", "content": text}
    return out


def envelope(job: Job, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
    if job.chat:
        kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
    else:
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + job.id,
        "object": kind,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }


def models_list(name: str, created: int, max_length: int) -> dict[str, Any]:
    entry = {"id": name, "object": "model", "created": created, "owned_by": "torch_precompile"}
    return {"object": "list", "data": [{**entry, "max_model_len": max_length}]}
