"""A chat request's ``tools`` and ``tool_choice``, and its answer's ``tool_calls``.

``tools`` go to the chat template (as transformers passes ``tools=`` to
``apply_chat_template``). ``tool_choice``: ``none`` (the answer is text), ``auto`` (the
default: the model's calls are read from its text by the parser its template
implies, or ``serve --tool-call-parser``), ``required`` and a named function (the
output held by the grammar engine to a list of calls, or to the function's
arguments, so the arguments always satisfy its ``parameters`` schema). The answer
reads the text through :class:`CallStream`: whole, a ``message`` with ``tool_calls``
(each with an id, ``type`` "function", ``function.name`` and ``function.arguments``
as a JSON string) and ``finish_reason`` "tool_calls"; streamed, OpenAI's deltas
(``tool_calls[index]`` with the id and name first, then pieces of the arguments).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from .errors import ApiError
from .tool_parsers import PARSERS, Call, Parser, named, required

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of its answer."""

    tools: tuple[dict[str, Any], ...]  # as sent, for the template
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parser: str | None = None  # the format ``auto`` reads
    parallel: bool = True

    def grammar(self) -> tuple[str, Any, str] | None:
        """The grammar ``required`` and a named function hold the output to."""
        schemas = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.choice == "named":
            return "json", schemas[self.name], "tool_choice"
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": s},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, s in schemas.items()
        ]
        many = {"minItems": 1} if self.parallel else {"minItems": 1, "maxItems": 1}
        return "json", {"type": "array", "items": {"anyOf": calls}, **many}, "tool_choice"

    def stream(self) -> CallStream | None:
        """A reader of this answer's calls (None for ``none``: the answer is text)."""
        if self.choice == "none":
            return None
        if self.choice == "named":
            return CallStream(named(self.name), {self.name}, forced=True)
        if self.choice == "required":
            return CallStream(required, self.names, forced=True)
        return CallStream(PARSERS[self.parser], self.names)

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def _parameters(tool: dict[str, Any]) -> Any:
    return tool["function"].get("parameters") or _NO_PARAMETERS


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'tools' must be a non-empty list", param="tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
        ):
            raise ApiError(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                param="tools",
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f"tools[{i}].function.name must be a string", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be an object", param="tools")
    return tuple(value)


def read_tools(body: dict[str, Any], parser: str | None, *, chat: bool = True) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, or None (no tools); ``parser`` the server's
    format for ``auto`` (None: it has none). Tools are for chats only."""
    if not chat:
        for name in ("tools", "tool_choice", "functions"):
            if body.get(name) is not None:
                raise ApiError(400, f"'{name}' is for /v1/chat/completions", param=name)
        return None
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise ApiError(
            400,
            "'functions' is OpenAI's old form: send 'tools' and 'tool_choice'",
            param="functions",
        )
    choice = body.get("tool_choice")
    if body.get("tools") is None:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    tools = _tools(body["tools"])
    names = {t["function"]["name"] for t in tools}
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    plan = {"tools": tools, "parallel": parallel is not False}
    if choice in (None, "auto"):
        if parser is None:
            raise ApiError(
                400,
                "tool_choice 'auto' needs a tool-call parser, and this model's chat template "
                "names none the server knows: start it with --tool-call-parser "
                f"({', '.join(PARSERS)}), or send tool_choice 'required' or a named function",
                param="tool_choice",
            )
        return ToolPlan(choice="auto", parser=parser, **plan)
    if choice in ("none", "required"):
        return ToolPlan(choice=choice, **plan)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            400,
            "'tool_choice' must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise ApiError(
            400, f"tool_choice names {name!r}, which is not in 'tools'", param="tool_choice"
        )
    return ToolPlan(choice="named", name=name, **plan)


class CallStream:
    """One answer's text read as content and calls: :meth:`feed` each piece, then
    :meth:`close`; each returns OpenAI's deltas of what became settled."""

    def __init__(self, parse: Parser, names: set[str], *, forced: bool = False) -> None:
        self.parse, self.names, self.forced = parse, names, forced
        self.text, self.content = "", 0
        self.sent: list[tuple[str, int]] = []  # per call: its id, arguments sent

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._deltas(final=False)

    def close(self) -> list[dict[str, Any]]:
        """The rest; in ``auto``, text that held no whole call is content after all."""
        if not self.forced and not self.sent and not self.message()[1]:
            rest, self.content = self.text[self.content :], len(self.text)
            return [{"content": rest}] if rest else []
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict[str, Any]]:
        parsed = self.parse(self.text, final)
        out = []
        if len(parsed.content) > self.content:
            out.append({"content": parsed.content[self.content :]})
            self.content = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if call.name is None or (not self.forced and call.name not in self.names):
                break  # not whole yet, or no tool's: sent as content at the close if none is
            if index == len(self.sent):
                self.sent.append((f"call_{uuid.uuid4().hex[:24]}", 0))
                head = {"name": call.name, "arguments": ""}
                out.append(
                    _call_delta(index, id=self.sent[index][0], type="function", function=head)
                )
            ident, done = self.sent[index]
            if len(call.arguments) > done:
                out.append(_call_delta(index, function={"arguments": call.arguments[done:]}))
                self.sent[index] = (ident, len(call.arguments))
        return out

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole answer: its content and its calls. In ``auto``, text whose calls
        are not all whole, valid JSON to a known tool is content, calls none."""
        parsed = self.parse(self.text, True)
        good = [c for c in parsed.calls if _valid(c, self.names)]
        if not good or (not self.forced and len(good) < len(parsed.calls)):
            return self.text, []
        calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in good
        ]  # fmt: skip
        return (parsed.content.strip() or None), calls


def _valid(call: Call, names: set[str]) -> bool:
    if not call.valid or call.name not in names:
        return False
    try:
        json.loads(call.arguments)
    except ValueError:
        return False
    return True


def _call_delta(index: int, **fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **fields}]}


def stream_choices(calls: CallStream, piece: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream chunk's choice (``delta.content`` the new text) as the chunks of its
    calls: one per delta, the last with the piece's finish and logprobs (finish
    ``tool_calls`` where the answer made calls and ended by itself)."""
    finish = piece["finish_reason"]
    deltas = calls.feed(piece["delta"]["content"]) + (calls.close() if finish else [])
    if finish == "stop" and calls.sent:
        finish = "tool_calls"
    index = piece["index"]
    out = [{"index": index, "finish_reason": None, "logprobs": None, "delta": d} for d in deltas]
    if finish or piece["logprobs"]:
        if not out:
            out.append({"index": index, "delta": {}})
        out[-1].update(finish_reason=finish, logprobs=piece["logprobs"])
    return out


def whole_choice(calls: CallStream, whole: dict[str, Any]) -> dict[str, Any]:
    """A whole answer's choice with its ``tool_calls`` read from its content."""
    calls.feed(whole["message"]["content"])
    content, found = calls.message()
    if found:
        whole["message"] = {"role": "assistant", "content": content, "tool_calls": found}
        if whole["finish_reason"] == "stop":
            whole["finish_reason"] = "tool_calls"
    return whole
