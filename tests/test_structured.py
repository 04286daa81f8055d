"""The server's constraints (serve/structured.py) against a real tokenizer: a
byte-level BPE of 4,096 tokens trained here on JSON and English, whose tokens mix
quotes, braces and words as a real model's do. Each test walks random allowed
tokens to the constraint's end (several seeds, leaning towards closing tokens as it
goes so every walk ends), decodes them with the tokenizer, and checks the text:
it parses and validates against the schema, matches the regex, is one of the choices.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from typing import Any

import llguidance  # noqa: F401 (the test extra installs it: a missing one fails, never skips)
import pytest
import torch
from conftest import ROOT
from fixtures.bpe import byte_level_bpe
from fixtures.json_schema import errors

from torch_precompile.serve.errors import ApiError
from torch_precompile.serve.structured import Grammars, requested
from torch_precompile.serve.tool_calls import read_tools
from torch_precompile.serve.tool_parsers import required

EOS = 2
# What the tests' schemas look like from pydantic (model_json_schema of a model with a
# nested model, an enum, an optional field and a list) and from OpenAI's strict mode.
PERSON = {
    "$defs": {
        "Address": {
            "properties": {
                "city": {"maxLength": 12, "title": "City", "type": "string"},
                "zip": {"pattern": "^[0-9]{5}$", "title": "Zip", "type": "string"},
            },
            "required": ["city", "zip"],
            "title": "Address",
            "type": "object",
            "additionalProperties": False,
        }
    },
    "properties": {
        "name": {"maxLength": 16, "title": "Name", "type": "string"},
        "age": {"maximum": 150, "minimum": 0, "title": "Age", "type": "integer"},
        "kind": {"enum": ["person", "company"], "title": "Kind", "type": "string"},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "tags": {"items": {"type": "string", "maxLength": 6}, "maxItems": 3, "type": "array"},
        "score": {"type": "number"},
        "home": {"$ref": "#/$defs/Address"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "nickname", "tags", "score", "home", "ok"],
    "title": "Person",
    "type": "object",
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "now"}}  # no parameters: {} only
NONE = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return _trained()


def _trained() -> Any:
    return _trained()


def _trained() -> Any:
    rng = random.Random(0)
    words = "the cat sat on a mat city name age kind zip home score tags ok true false null"
    corpus = [
        json.dumps({w: rng.randint(0, 999) for w in rng.sample(words.split(), 4)})
        for _ in range(300)
    ]
    corpus += [json.dumps({"name": w, "tags": words.split()[:3]}) for w in words.split()]
    corpus += ["the cat sat on the mat, héllo wörld 12345 ünïcode"] * 30
    return byte_level_bpe(corpus, 4096, ["<pad>", "<bos>", "<eos>"])


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars(tokenizer.to_str(), [EOS])


def _texts(tokenizer: Any) -> list[str]:
    return [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]


def walk(constraint: Any, texts: list[str], seed: int, vocab: int = 4100) -> list[int]:
    """Random allowed tokens until the constraint is done (or the end token is taken):
    at step s, a token that closes a value (``"``, ``}``, ``]``, then ``,``) with
    probability s/40, any allowed token otherwise."""
    rng, tokens = random.Random(seed), []
    for step in range(600):
        if constraint.done():
            return tokens
        mask = constraint.allowed_mask(vocab)
        assert mask.dtype == torch.bool and mask.shape == (vocab,)
        assert not mask[len(texts) :].any(), "a token past the tokenizer's vocabulary"
        allowed = mask.nonzero().flatten().tolist()
        assert allowed, f"nothing allowed after {tokens}"
        pick = rng.choice(allowed)
        if rng.random() < step / 40:
            for closing in ('"', "}", "]", ","):
                near = [t for t in allowed if t == EOS or closing in texts[t]]
                if near:
                    pick = EOS if EOS in near else rng.choice(near)
                    break
        constraint.accept(pick)
        if pick == EOS:
            return tokens
        tokens.append(pick)
    raise AssertionError("the walk did not end in 600 tokens")


def _walked(grammars: Grammars, tokenizer: Any, kind: str, source: Any, seeds: int = 6):
    texts = _texts(tokenizer)
    for seed in range(seeds):
        yield tokenizer.decode(walk(grammars.constraint(kind, source, "p"), texts, seed))


@pytest.mark.parametrize("schema", [PERSON, {"type": "object"}, WEATHER["function"]["parameters"]])
def test_every_walk_of_a_schema_parses_and_validates(
    grammars: Grammars, tokenizer: Any, schema: dict[str, Any]
) -> None:
    seen = set()
    for text in _walked(grammars, tokenizer, "json", schema):
        value = json.loads(text)
        assert errors(value, schema) == [], (text, errors(value, schema))
        assert isinstance(value, dict)
        seen.add(text)
    assert len(seen) > 3, seen  # the walks differ: the mask allows more than one way


def test_a_regex_and_a_choice(grammars: Grammars, tokenizer: Any) -> None:
    for text in _walked(grammars, tokenizer, "regex", r"[0-9]{3}-[a-z]{2,5}( [A-Z]+)?"):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}( [A-Z]+)?", text), text
    choices = ['the "cat"', "the mat", "héllo\nwörld", "a\\b"]
    got = set(_walked(grammars, tokenizer, "choice", choices, seeds=12))
    assert got <= set(choices) and len(got) > 1, got


def test_the_forced_tool_calls_validate(grammars: Grammars, tokenizer: Any) -> None:
    """tool_choice required (a list of calls, each one of the tools) and named (the
    function's arguments): every walk reads as calls whose arguments validate."""
    body = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    plan = read_tools(body, parser=None)
    kind, source, _ = plan.grammar()
    for text in _walked(grammars, tokenizer, kind, source):
        calls = required(text, True).calls
        assert calls and all(c.name in ("get_weather", "now") for c in calls), text
        for c in calls:
            schema = WEATHER["function"]["parameters"] if c.name == "get_weather" else NONE
            assert errors(json.loads(c.arguments), schema) == [], text
    named = read_tools(
        {**body, "tool_choice": {"type": "function", "function": {"name": "now"}}}, None
    )
    assert named.choice == "named" and named.grammar()[1]["additionalProperties"] is False
    one = read_tools({**body, "parallel_tool_calls": False}, None)
    for text in _walked(grammars, tokenizer, *one.grammar()[:2]):
        assert len(json.loads(text)) == 1, text


def test_compiled_grammars_are_kept_and_each_constraint_is_its_own(tokenizer: Any) -> None:
    grammars = Grammars(tokenizer.to_str(), [EOS], cached=2)
    texts = _texts(tokenizer)
    first = grammars.constraint("json", PERSON, "p")
    second = grammars.constraint("json", json.loads(json.dumps(PERSON)), "p")  # same text
    assert len(grammars) == 1
    walk(first, texts, 0)
    assert first.done() and not second.done()  # a copy: walking one leaves the other
    assert json.loads(tokenizer.decode(walk(second, texts, 1)))
    for schema in ({"type": "object"}, {"type": "array"}, PERSON):
        grammars.constraint("json", schema, "p")
    assert len(grammars) == 2  # the least recently used is dropped


NOPE, REGEX = {"name": "x", "schema": {"type": "nope"}}, {"structured_outputs": {"regex": "a"}}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": NOPE}}, "does not compile"),
        ({"structured_outputs": {"regex": "(a|b"}}, "does not compile"),
        ({"structured_outputs": {"grammar": "start: ("}}, "does not compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "takes one of"),
        ({"structured_outputs": {"choice": []}}, "non-empty list"),
        ({"response_format": {"type": "json_schema"}}, "needs 'json_schema'"),
        ({"response_format": {"type": "xml"}}, "is not one of"),
        ({"response_format": {"type": "json_object"}, **REGEX}, "send one"),
    ],
)  # fmt: skip
def test_bad_grammars_are_400s(grammars: Grammars, body: dict[str, Any], words: str) -> None:
    with pytest.raises(ApiError) as caught:
        asked = requested(body)
        grammars.constraint(*asked)
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message


def test_a_file_without_an_end_token_is_a_400(tokenizer: Any) -> None:
    with pytest.raises(ApiError) as caught:  # llguidance would raise a ValueError: a 500
        Grammars(tokenizer.to_str(), []).constraint("json", PERSON, "response_format")
    assert caught.value.status == 400 and "end token" in caught.value.message


def test_without_llguidance_the_400_names_the_extra(tokenizer: Any) -> None:
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "from torch_precompile.serve.structured import Grammars\n"
        "from torch_precompile.serve.errors import ApiError\n"
        f"g = Grammars({tokenizer.to_str()!r}, [2])\n"
        "try:\n    g.constraint('json', {'type': 'object'}, 'response_format')\n"
        "except ApiError as e:\n    print(e.status, e.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.startswith("400 ") and "torch_precompile[serve]" in out.stdout, out
