"""A request's prompt: a completion's text or token ids, a chat's messages made ready
for the file's template.

A message's ``content`` is a string, ``null`` (an assistant's turn that only
called tools: rendered as an empty string, its ``tool_calls`` handed to the
template as transformers hands them) or a list of content parts, the form the
``openai`` SDK, LangChain and guidellm send: the text parts are joined with
``"\\n"`` as vLLM joins them; a part of another type (``image_url``,
``input_audio``, ...) is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.text import require_unicode
from .errors import ApiError


def prompt_batch(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A completion's ``prompt`` as a list of prompts (strings, or lists of token ids:
    what lm-eval's ``local-completions`` sends with ``--batch_size``): a body for each,
    its ``prompt`` that one. Any other body, a batch of one included: ``[body]``."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return [body]
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return [body]  # token ids, or a mix completion_prompt refuses
    if body.get("stream"):
        message = "a list of prompts is answered whole: leave out 'stream' or send one prompt"
        raise ApiError(400, message, param="stream")
    return [dict(body, prompt=p) for p in prompt]


def completion_prompt(
    body: dict[str, Any], encode: Callable[[str], list[int]], max_length: int
) -> list[int]:
    """``prompt``: a string (tokenized by ``encode``) or token ids (a list of prompts is
    split before, by :func:`prompt_batch`).
    A list of ids too long to fit is refused before each id is looked at."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and len(prompt) >= max_length:
        raise ApiError(
            400,
            f"a prompt of {len(prompt)} tokens leaves no room for an answer in the model's "
            f"max_length={max_length}: shorten it",
            param="prompt",
        )
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if any(t < 0 for t in prompt):
            raise ApiError(400, "token ids must be 0 or more", param="prompt")
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    raise ApiError(
        400,
        "'prompt' must be a string, a list of token ids, or a list of either",
        param="prompt",
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages`` checked, each with its ``content`` as one string."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        out.append({**m, "content": _content(i, m.get("content"))})
    return out


def _content(i: int, content: Any) -> str:
    where = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return require_unicode(content, where, "messages")
    if not isinstance(content, list):
        raise ApiError(
            400, f"{where} must be a string, a list of text parts or null", param="messages"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, f"{where}[{j}] must be an object with a 'type'", param="messages")
        if part["type"] != "text":
            raise ApiError(
                400,
                f"{where}[{j}] is of type {part['type']!r}: this server takes text parts only",
                param="messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"{where}[{j}].text must be a string", param="messages")
        texts.append(require_unicode(text, f"{where}[{j}].text", "messages"))
    return "\n".join(texts)
