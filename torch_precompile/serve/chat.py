"""A chat rendered with the tokenizer's own template, saved in the file at build.

As transformers renders it (``apply_chat_template``): jinja2's immutable
sandbox (a template is code from the file's author: it may not touch Python
objects), ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension,
and the helpers templates call (``raise_exception``, ``strftime_now``,
``tojson``), with ``add_generation_prompt=True`` and the special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .protocol import ApiError


class _TemplateRefused(Exception):
    """A template's own ``raise_exception`` (a chat it does not accept)."""


def _raise(message: str) -> None:
    raise _TemplateRefused(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def chat_renderer(template: str, tokens: dict[str, str]) -> Callable[[list[dict[str, Any]]], str]:
    """``render(messages) -> prompt text``; a template that refuses a chat raises ``ApiError``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **tokens)
        except _TemplateRefused as exc:
            raise ApiError(
                400, f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        except jinja2.TemplateError as exc:
            raise ApiError(
                400, f"the chat template failed on the messages: {exc}", param="messages"
            ) from None

    return render
