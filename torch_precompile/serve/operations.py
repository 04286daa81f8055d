"""The routes around generation: ``/tokenize``, ``/detokenize``, ``/version``, ``/metrics``.

``/tokenize`` and ``/detokenize`` take and give vLLM's shapes. Tokenize: a
``prompt`` string (``add_special_tokens``, default true) or a chat's
``messages`` (``add_generation_prompt``, default true; ``add_special_tokens``,
default false: the template writes its own), ``return_token_strs`` (default
false); the answer is ``{"count", "max_model_len", "tokens", "token_strs"}``.
Detokenize: ``tokens``, a list of ids; the answer is ``{"prompt"}``, special
tokens kept. ``model`` may be left out; given, it must be the served one.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.text import Tokens
from .body import parse_json, read_body
from .errors import ApiError
from .metrics import Metrics
from .prompts import chat_messages

OffLoop = Callable[[Callable[[], Any]], Awaitable[Any]]


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be bool, got {type(value).__name__}", param=name)
    return value


def _object(raw: bytes, served: str) -> dict[str, Any]:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(
            404, f"the model '{model}' does not exist: this server serves '{served}'", param="model"
        )
    return body


class Operations:
    """The handlers, over the app's tokens, metrics and worker threads."""

    def __init__(
        self,
        *,
        name: str,
        tokens: Tokens,
        metrics: Metrics,
        off_loop: OffLoop,
        max_request_bytes: int,
        vocab: Callable[[], int],
    ) -> None:
        self.name, self.tokens, self.metrics, self.off_loop = name, tokens, metrics, off_loop
        self.cap, self.vocab = max_request_bytes, vocab

    def tokenized(self, raw: bytes) -> dict[str, Any]:
        body = _object(raw, self.name)
        strs = _flag(body, "return_token_strs", False)
        if "messages" in body:
            messages = chat_messages(body)
            generation = _flag(body, "add_generation_prompt", True)
            special = _flag(body, "add_special_tokens", False)
            ids = self.tokens.render(messages, generation=generation, special=special)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(
                    400, "give 'prompt' (a string) or 'messages' to tokenize", param="prompt"
                )
            ids = self.tokens.encode(prompt, special=_flag(body, "add_special_tokens", True))
        return {
            "count": len(ids),
            "max_model_len": self.tokens.max_length,
            "tokens": ids,
            "token_strs": self.tokens.spellings(ids) if strs else None,
        }

    def detokenized(self, raw: bytes) -> dict[str, Any]:
        body = _object(raw, self.name)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab()]
        if bad:
            raise ApiError(
                400, f"token id {bad[0]} is not in the vocabulary of {self.vocab()}", param="tokens"
            )
        return {"prompt": self.tokens.decode(ids)}

    async def tokenize(self, request: Request) -> Response:
        raw = await read_body(request, self.cap)
        return JSONResponse(await self.off_loop(lambda: self.tokenized(raw)))

    async def detokenize(self, request: Request) -> Response:
        raw = await read_body(request, self.cap)
        return JSONResponse(await self.off_loop(lambda: self.detokenized(raw)))

    async def version(self, request: Request) -> Response:
        try:  # the installed distribution's (the package's own __init__ is a layer above)
            version = importlib.metadata.version("torch_precompile")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        return JSONResponse({"version": version})

    async def prometheus(self, request: Request) -> Response:
        if not self.metrics.enabled:
            raise ApiError(
                501,
                "metrics need prometheus-client: pip install prometheus-client "
                "(or the package's 'serve' extra)",
                kind="server_error",
            )
        data, kind = self.metrics.exposition()
        return Response(data, media_type=kind)
