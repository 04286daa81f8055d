"""The tool-call parsers (serve/tool_parsers.py) and the answer's calls
(serve/tool_calls.py): each format read whole, and streamed in pieces of every
size (one character at a time, random cuts), which must add up to the whole
answer: the same content, the same calls, each call's id and name in its first
delta and then only pieces of its arguments."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from torch_precompile.serve.errors import ApiError
from torch_precompile.serve.tool_calls import CallStream, read_tools
from torch_precompile.serve.tool_parsers import PARSERS, named, parser_for, required

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add"}},
]
NAMES = {"get_weather", "add"}
ARGS = '{"city": "Paris \\"left\\" bank </tool_call>", "days": [1, {"a": "}"}], "x": -2.5e3}'

CASES = [
    # (parser, text, content, [(name, arguments)])
    ("hermes", "<tool_call>\n" + '{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call>",
     None, [("get_weather", ARGS)]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
     "Let me look.", [("add", '{"a": 1}'), ("get_weather", "{}")]),
    ("hermes", 'x < y and <tool_cal is no call', 'x < y and <tool_cal is no call', []),
    # Arguments written first: read once the call is whole.
    ("hermes", '<tool_call>{"arguments": {"a": 2}, "name": "add"}</tool_call>', None,
     [("add", '{"a": 2}')]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}', None,
     [("add", '{"a": 1, "b": [2, 3]}')]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("add", '{"a": 1}'), ("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json", "  The answer is {not a call}.", "  The answer is {not a call}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
]  # fmt: skip


def _cuts(text: str, how: str, seed: int = 0) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[at : at + n])
        at += n
    return pieces


def streamed(stream: CallStream, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """What a client makes of the deltas: the content, and each call's name and
    arguments (the id and name come first, once; then arguments only)."""
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.close()
    content, calls, ids = "", [], []
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1, d
        content += d.get("content", "")
        for call in d.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function", call
                assert call["function"]["arguments"] == "", call
                calls.append([call["function"]["name"], ""])
                ids.append(call["id"])
            else:
                assert set(call) == {"index", "function"}, call
                assert set(call["function"]) == {"arguments"}, call
                calls[call["index"]][1] += call["function"]["arguments"]
    assert len(set(ids)) == len(ids)
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("how", ["whole", "chars", "random"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_calls_whole_and_streamed(case: int, how: str) -> None:
    parser, text, content, calls = CASES[case]
    whole = CallStream(PARSERS[parser], NAMES)
    whole.feed(text)
    got_content, got_calls = whole.message()
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
    for c in got_calls:
        json.loads(c["function"]["arguments"])
    for seed in range(3):
        s_content, s_calls = streamed(CallStream(PARSERS[parser], NAMES), _cuts(text, how, seed))
        assert s_calls == calls, (s_calls, _cuts(text, how, seed))
        assert s_content == (content or "") if not calls else s_content.strip() == (content or "")


def test_a_call_that_is_not_one_is_content() -> None:
    """auto: text whose call does not parse, or names no tool, stays content whole. A
    stream sends a call once its name is a tool's, so one that names no tool comes as
    content at the end; one whose JSON breaks off is already sent, as far as it got."""
    broken = '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    for text in (broken, unknown):
        stream = CallStream(PARSERS["hermes"], NAMES)
        stream.feed(text)
        assert stream.message() == (text, [])
    assert streamed(CallStream(PARSERS["hermes"], NAMES), list(unknown)) == (unknown, [])
    assert streamed(CallStream(PARSERS["hermes"], NAMES), list(broken)) == ("", [("add", '{"a": ')])


def test_the_forced_forms() -> None:
    """named: the text is the function's arguments; required: a list of calls."""
    args = '{"a": [1, 2], "s": "]}"}'
    for how in ("whole", "chars", "random"):
        assert streamed(CallStream(named("add"), NAMES, forced=True), _cuts(args, how)) == (
            "",
            [("add", args)],
        )
        first, second = (
            f'{{"name": "add", "parameters": {args}}}',
            '{"name": "get_weather", "parameters": {}}',
        )
        text = f"[{first}, {second}]"
        out = streamed(CallStream(required, NAMES, forced=True), _cuts(text, how))
        assert out == ("", [("add", args), ("get_weather", "{}")]), out


def test_the_parser_is_read_from_the_template() -> None:
    assert (
        parser_for("{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}<tool_call>")
        == "hermes"
    )
    llama = '{{- "<|python_tag|>" }} {"name": function name, "parameters": ...} ipython'
    assert parser_for(llama) == "llama3_json"
    assert parser_for("{{ messages }}") is None and parser_for(None) is None


RM = {"type": "function", "function": {"name": "rm"}}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"tools": [], "tool_choice": "auto"}, "non-empty list"),
        ({"tools": [{"type": "function"}]}, "must be {'type': 'function'"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "name must be a string"),
        ({"tools": TOOLS, "tool_choice": RM}, "'rm', which is not"),
        ({"tools": TOOLS, "tool_choice": "always"}, "must be 'none', 'auto'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS}, "--tool-call-parser"),
        ({"functions": [{"name": "f"}]}, "old form"),
        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "boolean"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s(body: dict[str, Any], words: str) -> None:
    with pytest.raises(ApiError) as caught:
        read_tools(body, parser=None)
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message


def test_tool_choice_plans() -> None:
    none = read_tools({"tools": TOOLS, "tool_choice": "none"}, None)  # no parser needed
    assert none.stream() is None and none.grammar() is None and none.tools == tuple(TOOLS)
    assert read_tools({"tools": TOOLS}, "hermes").choice == "auto"
    assert read_tools({"tools": TOOLS}, "hermes").grammar() is None
    plan = read_tools({"tools": TOOLS, "tool_choice": "required"}, None)
    assert plan.grammar()[1]["minItems"] == 1 and "maxItems" not in plan.grammar()[1]
