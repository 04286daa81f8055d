"""A chat rendered with the tokenizer's own template, saved in the file at build.

As transformers renders it (``apply_chat_template``): jinja2's immutable
sandbox (a template is code from the file's author: it may not touch Python
objects), ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension,
and the helpers templates call (``raise_exception``, ``strftime_now``,
``tojson``), with ``add_generation_prompt=True`` and the special tokens.
A template that fails on a chat, by its own ``raise_exception``, jinja2's error or a
Python one (``None + "x"``: a ``TypeError``), refuses it with a 400: what failed is
in the messages the client sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .errors import ApiError


class _TemplateRefused(Exception):
    """A template's own ``raise_exception`` (a chat it does not accept)."""


def _raise(message: str) -> None:
    raise _TemplateRefused(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def chat_renderer(template: str, tokens: dict[str, str]) -> Callable[..., str]:
    """``render(messages, generation=True, tools=None) -> prompt text``
    (``generation``: with ``add_generation_prompt``; ``tools``: the request's, as
    transformers passes them); a template that refuses a chat raises ``ApiError``."""
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

    def render(
        messages: list[dict[str, Any]], generation: bool = True, tools: list[Any] | None = None
    ) -> str:
        try:
            return compiled.render(
                messages=messages, tools=tools, add_generation_prompt=generation, **tokens
            )
        except _TemplateRefused as exc:
            raise ApiError(
                400, f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        except (
            jinja2.TemplateError,
            ArithmeticError,
            AttributeError,
            LookupError,
            TypeError,
            ValueError,
        ) as exc:
            raise ApiError(
                400,
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}",
                param="messages",
            ) from None
        except RecursionError:  # a message nested past Python's limit (tojson)
            raise ApiError(
                400, "the chat template failed on the messages: nested too deep", param="messages"
            ) from None

    return render
