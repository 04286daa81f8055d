"""A model's tool calls read from its text: each format a function of the text so far.

A parser takes the text generated so far and whether it is all there, and returns
what of it is settled: the content to show, and each call's name (once whole) and
the part of its arguments' JSON written so far. A stream sends the difference
from one step's answer to the next (``tool_calls.py``), so a call split across any
number of pieces comes out the same as whole. Formats:

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block a call; the text before the first block is the content.
- ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}``
  (``;`` between calls, ``<|python_tag|>`` before them), or else it is content.
- ``named`` and ``required``: what the grammar forces for ``tool_choice`` a named
  function (the text is its arguments) and ``required`` (a JSON list of
  ``{"name", "parameters"}``), whichever template the model has, as vLLM's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


@dataclasses.dataclass
class Call:
    """A call as far as it is settled: ``name`` None until it is whole; ``valid``
    False for a call that is whole but not one (its JSON does not parse)."""

    name: str | None = None
    arguments: str = ""
    valid: bool = True


@dataclasses.dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = dataclasses.field(default_factory=list)


Parser = Callable[[str, bool], Parsed]


def value_end(text: str) -> int | None:
    """Where the JSON value at the start of ``text`` ends (after leading whitespace),
    or None while it is not whole. A bare number or word ends at ``,``/``}``/``]``."""
    depth, in_string, escaped = 0, False, False
    start = len(text) - len(text.lstrip())
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and c in ", \n\t;":
            return i
    return None


def _call(body: str, final: bool) -> Call:
    """One ``{"name": ..., "arguments"|"parameters": ...}`` object, settled as far as it is."""
    head = _HEAD.match(body)
    if head is not None:
        name = json.loads(f'"{head.group(1)}"')
        rest = body[head.end() :]
        end = value_end(rest)
        arguments = rest if end is None else rest[:end]
        return Call(name, arguments.strip() if final or end is not None else arguments.lstrip())
    if not final:
        return Call()
    try:  # written another way (arguments first, other spacing): read whole
        obj = json.loads(body)
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(obj["name"], str) and args is not None:
            return Call(obj["name"], json.dumps(args, ensure_ascii=False))
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return Call(valid=False)


def _held(text: str, marker: str) -> int:
    """How many chars at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def hermes(text: str, final: bool) -> Parsed:
    first = text.find(_OPEN)
    if first < 0:
        keep = len(text) if final else len(text) - _held(text, _OPEN)
        return Parsed(text[:keep])
    out, at = Parsed(text[:first]), first + len(_OPEN)
    while True:
        body = text[at:]
        # The call's JSON ends where its object closes: a "</tool_call>" inside a
        # string of its arguments is text, not the block's end.
        end = value_end(body) if body.lstrip().startswith("{") else None
        if end is None:
            inner, closed, _ = body.partition(_CLOSE)
            if not (closed or final):
                if body.strip():
                    out.calls.append(_call(inner[: len(inner) - _held(inner, _CLOSE)], False))
                return out
            out.calls.append(_call(inner, True))
            end = len(inner)
        else:
            out.calls.append(_call(body[:end], True))
        following = text.find(_OPEN, at + end)
        if following < 0:
            return out
        at = following + len(_OPEN)


def llama3_json(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not final and (_PYTHON_TAG.startswith(body) or (tagged and not body)):
        return Parsed()  # undecided: the tag, or only whitespace, so far
    if tagged and not body:
        return Parsed()
    if not body.startswith("{"):
        return Parsed(text)
    return Parsed(calls=_sequence(body, ";", final))


def _sequence(body: str, separator: str, final: bool) -> list[Call]:
    """Call objects one after another, ``separator`` (and whitespace) between them."""
    calls, at = [], 0
    while at < len(body):
        rest = body[at:].lstrip(separator + " \n\t")
        if not rest or rest[0] != "{":
            break
        at = len(body) - len(rest)
        end = value_end(rest)
        if end is None:
            calls.append(_call(rest, final))
            break
        calls.append(_call(rest[:end], True))
        at += end
    return calls


def required(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    return Parsed(calls=_sequence(body[1:], ",", final) if body.startswith("[") else [])


def named(name: str) -> Parser:
    def parse(text: str, final: bool) -> Parsed:
        return Parsed(calls=[Call(name, text.strip() if final else text.lstrip())])

    return parse


PARSERS: dict[str, Parser] = {"hermes": hermes, "llama3_json": llama3_json}


def parser_for(template: str | None) -> str | None:
    """The format a chat template's model writes its calls in, read from the template."""
    if template is None:
        return None
    if _OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return None
