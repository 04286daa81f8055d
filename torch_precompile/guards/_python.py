"""Messages that are both run and printed: the runtime renders them with the
values of a call, ``to_python()`` prints them as f-strings over the same
values' expressions, so a guard's words are written once, on the guard."""

from __future__ import annotations

import math
from typing import Any

import torch


class Code(str):
    """A piece of a message that is an expression in generated code."""


Parts = list[str]


def render(parts: Parts) -> str:
    """The message of a call: every part already holds the call's text."""
    return "".join(parts)


def fstring(parts: Parts) -> str:
    """Code of an f-string giving the same message in a generated module."""
    body = "".join(
        "{" + p + "}" if isinstance(p, Code) else p.replace("{", "{{").replace("}", "}}")
        for p in parts
    )
    return ("f" if any(isinstance(p, Code) for p in parts) else "") + repr(body)


def literal(value: Any) -> str | None:
    """Python code for a plain value, or None when it has no literal form."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({repr(value)!r})"
    if isinstance(value, (tuple, list)):
        items = [literal(v) for v in value]
        if any(i is None for i in items):
            return None
        if isinstance(value, tuple):
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"  # type: ignore[arg-type]
        return "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def shape_text(shape: tuple[Any, ...] | list[Any]) -> str:
    """``(2, s0)``; a one-element shape keeps its comma."""
    inner = ", ".join(str(s) for s in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).replace("torch.", "")


def plain(value: Any) -> Any:
    """A value as guards record it: dtypes and devices by name, lists as tuples."""
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, list):
        return tuple(plain(v) for v in value)
    return value
