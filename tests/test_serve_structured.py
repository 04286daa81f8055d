"""Structured outputs and tool calls through ``torch-precompile serve``, spoken to with
the ``openai`` SDK.

The model is tests/fixtures/trained_lm.py's Llama (trained here on the GPL's text,
so its logits are not flat), saved with ``save_pretrained``, loaded back and built
with a Hermes-style chat template that renders ``tools``, assistant ``tool_calls`` and
``tool`` messages. The server runs where transformers cannot be imported. Every
answer the grammar holds is checked against its schema (tests/fixtures/json_schema.py)
and, sampled, for several seeds; a stream's calls are the whole answer's.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
import llguidance  # noqa: E402, F401 (the test extra installs it: a missing one fails, never skips)
from fixtures.json_schema import errors  # noqa: E402
from test_serve import Server  # noqa: E402

from tests.fixtures.trained_lm import train  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402
from torch_precompile.serve.structured import Grammars  # noqa: E402

TEMPLATE = (
    "{% if tools %}<bos>system: Tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    '{% endfor %}</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n'
    "{% endif %}{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)
SLOTS, MAX_LENGTH = 4, 1024  # the tools in the prompt: 450 tokens of this 384-token BPE
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # no other keys: additionalProperties false

    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    kind: Literal["person", "company"]
    ok: bool


def _build(root: Path) -> None:
    model, tok = train()
    tok.chat_template = TEMPLATE
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "model").eval()
    tok = transformers.AutoTokenizer.from_pretrained(root / "model")
    generator = compile_generator(model, max_batch=SLOTS, max_length=MAX_LENGTH, tokenizer=tok)
    Precompile.save(root / "trained.pt", generator)


@pytest.fixture(scope="module")
def built(store: Any) -> Path:
    key = {"template": TEMPLATE, "slots": SLOTS, "max_length": MAX_LENGTH}
    return store.saved("serve-trained", key, _build, folder=True)


@pytest.fixture(scope="module")
def server(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("structured") / "tiny.pt"
    path.symlink_to(built / "trained.pt")
    server = Server(path)
    yield server
    log = server.stop()
    assert "IMPORTED []" in log, log  # neither transformers nor the compiler


def test_parse_returns_a_valid_object_for_every_seed(server: Server) -> None:
    """The SDK's ``parse`` sends the model's strict JSON schema and reads the answer
    back into the pydantic model; sampled, for 5 seeds."""
    client, answers = server.client(), set()
    for seed in range(5):
        out = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=Person,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        value = json.loads(choice.message.content)
        assert errors(value, Person.model_json_schema()) == [], value
        answers.add(choice.message.content)
    assert len(answers) > 1, answers  # sampled: the seeds give different objects


def test_json_object_and_structured_outputs(server: Server) -> None:
    """json_object, and vLLM's structured_outputs regex and choice on /v1/completions.
    A model trained on prose seldom closes a quote, so a json_object's first key runs
    to max_tokens unbiased: the request biases ``"`` and ``}`` (+10, applied before the
    grammar's mask), as a client may."""
    client = server.client()
    quote, brace = (
        server.request("POST", "/tokenize", {"prompt": c, "add_special_tokens": False})[1]["tokens"]
        for c in '"}'
    )
    bias = {str(quote[0]): 10, str(brace[0]): 10}
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            logit_bias=bias,
        )
        assert out.choices[0].finish_reason == "stop", out
        assert isinstance(json.loads(out.choices[0].message.content), dict), out
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        out = client.completions.create(
            model="tiny",
            prompt="the code is",
            max_tokens=20,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert re.fullmatch(pattern, out.choices[0].text), out
    choices = ["yes", "no", "the Program"]
    out = client.completions.create(
        model="tiny",
        prompt="the answer is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop", out


def test_n_choices_each_hold_the_grammar_and_older_fields_are_read(server: Server) -> None:
    """``n`` 3 with a grammar: each choice its own copy of it from the start, each
    answer held (sampled, so they differ); vLLM's older ``guided_choice`` and
    ``guided_regex`` hold the output as ``structured_outputs`` does."""
    client = server.client()
    choices = ["yes", "no", "the Program", "the License"]
    out = client.completions.create(
        model="tiny", prompt="the answer is", max_tokens=20, n=3, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices), out
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=20, n=3, temperature=1.0, seed=2,
        extra_body={"guided_regex": pattern},
    )  # fmt: skip
    texts = [c.message.content for c in out.choices]
    assert all(re.fullmatch(pattern, t) for t in texts) and len(set(texts)) > 1, texts
    out = client.completions.create(
        model="tiny", prompt="the answer is", max_tokens=20, temperature=0,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert out.choices[0].text in choices, out


def test_lark_and_gbnf_grammars_and_a_structural_tag(server: Server) -> None:
    """``structured_outputs.grammar`` in Lark and in GBNF (llama.cpp's, what vLLM's
    xgrammar users send) holds the output; a ``structural_tag`` leaves text free
    until its trigger, then holds what follows to the structure: here each ``" the"``
    this GPL-trained model writes goes on ``" [<digit>]"``."""
    client = server.client()
    for grammar, pattern in (
        ('start: "code " DIGIT DIGIT\nDIGIT: /[0-9]/', r"code [0-9]{2}"),
        ('root ::= [a-c] [a-c]? "-" [0-9] [0-9]?', r"[a-c]{1,2}-[0-9]{1,2}"),
    ):
        for seed in range(2):
            out = client.completions.create(
                model="tiny", prompt="the code is", max_tokens=30, temperature=1.0, seed=seed,
                extra_body={"structured_outputs": {"grammar": grammar}},
            )  # fmt: skip
            assert re.fullmatch(pattern, out.choices[0].text), (grammar, out)
            assert out.choices[0].finish_reason == "stop", out
    tag = {
        "structures": [{"begin": " the [", "schema": {"type": "integer", "minimum": 0,
                        "maximum": 9}, "end": "]"}],
        "triggers": [" the"],
    }  # fmt: skip
    out = client.completions.create(
        model="tiny", prompt="You may convey", max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}},
    )  # fmt: skip
    text = out.choices[0].text
    starts = [m.start() for m in re.finditer(" the", text)]
    assert starts, text  # the trigger came, and each time the structure followed
    assert all(re.match(r" the \[[0-9]\]", text[at:]) or len(text) - at < 8 for at in starts), text


def _big_schema(salt: int, keys: int = 4000) -> dict[str, Any]:
    """An object of ``keys`` required string keys, each its own pattern: seconds of
    compile, every time new (``salt``) to the server's cache."""
    properties = {
        f"k{salt}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 9}}}x{i}$"}
        for i in range(keys)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def test_a_large_new_schema_compiles_beside_the_streams(server: Server, built: Path) -> None:
    """Three clients stream while a fourth sends a schema whose compile takes seconds
    (timed here first, on the file's tokenizer): the compile runs on a request worker,
    so no stream's gap between tokens while it compiles is past max(1 s, twice the
    longest gap of a calm window just before) (this 2-core machine is shared: of three
    tries, each with a new schema, one must pass; a stall would repeat)."""
    tok = transformers.AutoTokenizer.from_pretrained(built / "model")
    grammars = Grammars(tok.backend_tokenizer.to_str(), [tok.eos_token_id])
    keys = 2000
    while True:  # a schema whose compile, on the engine's step, would stall past the bar
        keys *= 2
        began = time.perf_counter()
        grammars.constraint("json", _big_schema(-keys, keys), "p")
        compile_s = time.perf_counter() - began
        if compile_s > 1.5 or keys >= 32000:
            break
    assert compile_s > 1.0, (compile_s, keys)
    gaps: list[tuple[float, float]] = []  # (gap, when it ended)
    stop = threading.Event()

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": f"the {i} terms", "max_tokens": 200}
        body.update(stream=True, ignore_eos=True, temperature=0)
        server.stream_gaps(body, gaps, stop)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    tries: list[tuple[float, float, float]] = []  # (during, calm, compile and answer)
    try:
        while len(gaps) < 20:
            time.sleep(0.05)
        for salt in range(3):
            quiet = time.perf_counter()
            time.sleep(1.5)
            began = time.perf_counter()
            calm = max(g for g, end in gaps if end > quiet)
            schema = {"name": "big", "schema": _big_schema(salt, keys)}
            body = {"model": "tiny", "messages": ASK, "max_tokens": 2}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
            status, answer = server.request("POST", "/v1/chat/completions", body)
            ended = time.perf_counter()
            assert status == 200, answer
            time.sleep(0.3)  # a gap that ends just after the answer counts too
            during = max(g for g, end in gaps if end > began)
            tries.append((during, calm, ended - began))
            if during < max(1.0, 2 * calm):
                break
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    during, calm, took = tries[-1]
    assert took > 1.0 and during < max(1.0, 2 * calm), (compile_s, tries)


def _streamed(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    calls: list[list[str]] = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    assert call.id and call.function.name, call
                    calls.append([call.function.name, call.function.arguments or ""])
                else:
                    assert call.id is None and call.function.name is None, call
                    calls[call.index][1] += call.function.arguments
    return [tuple(c) for c in calls], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_validate_whole_and_streamed(server: Server, tool_choice: str) -> None:
    """tool_choice required and a named function: each answer's calls are tools',
    their arguments valid JSON of the function's schema; a stream with the same seed
    gives the same calls, in OpenAI's deltas. (Required asks for one call: this model,
    let go on, writes calls to max_tokens.)"""
    client = server.client()
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        request = dict(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, ADD],
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_tokens=150,
            parallel_tool_calls=False,
        )
        out = client.chat.completions.create(**request)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls", out
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert calls and all(c.type == "function" and c.id for c in message.tool_calls)
        if tool_choice == "named":
            assert [n for n, _ in calls] == ["get_weather"] and message.content is None
        for name, arguments in calls:
            assert errors(json.loads(arguments), SCHEMAS[name]) == [], arguments
        streamed, finish = _streamed(client.chat.completions.create(**request, stream=True))
        assert streamed == calls and finish == "tool_calls", (streamed, calls)


def test_tools_and_their_history_are_rendered_by_the_template(server: Server, built: Path) -> None:
    """The prompt is the template's rendering with ``tools=`` (transformers' own), a
    history of calls and ``tool`` answers included; ``tool_choice`` auto reads the
    model's text with the template's parser (hermes) and none leaves it text."""
    tok = transformers.AutoTokenizer.from_pretrained(built / "model")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2}'}}  # fmt: skip
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
    ]
    client = server.client()
    for messages in (ASK, history):
        for tool_choice in ("auto", "none"):
            out = client.chat.completions.create(
                model="tiny", messages=messages, tools=[WEATHER, ADD], tool_choice=tool_choice,
                max_tokens=8, temperature=0,
            )  # fmt: skip
            as_sent = [{**m, "content": m["content"] or ""} for m in messages]
            text = tok.apply_chat_template(
                as_sent, tools=[WEATHER, ADD], add_generation_prompt=True, tokenize=False
            )
            assert "<tools>" in text and ('"a": 2' in text) == (messages is history)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert out.usage.prompt_tokens == len(ids), tool_choice
            assert out.choices[0].message.tool_calls is None  # this model writes no call
            assert out.choices[0].finish_reason in ("stop", "length")


NOPE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
RM = {"type": "function", "function": {"name": "rm"}}
BOTH = {"tool_choice": "required", "response_format": {"type": "json_object"}}


@pytest.mark.parametrize(
    ("extra", "words", "param"),
    [
        ({"response_format": NOPE}, "does not compile", "response_format"),
        ({"tools": [WEATHER], "tool_choice": RM}, "not in 'tools'", "tool_choice"),
        ({"tools": [WEATHER], **BOTH}, "both set", "tool_choice"),
        ({"guided_json": {}, "structured_outputs": {"regex": "a"}}, "send one", "guided_json"),
        ({"structured_outputs": {"grammar": "start: x"}}, "does not compile", "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s(
    server: Server, extra: dict[str, Any], words: str, param: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    status, answer = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and words in answer["error"]["message"], answer
    assert answer["error"]["param"] == param, answer


def test_the_same_constraint_holds_generate(built: Path) -> None:
    """The server's constraint is the engine's protocol: ``Generator.generate`` takes
    it too, and its sampled rows each parse and validate."""
    generator = Precompile.load(built / "trained.pt")
    tok = transformers.AutoTokenizer.from_pretrained(built / "model")
    grammars = Grammars(tok.backend_tokenizer.to_str(), generator.spec.eos_token_id)
    schema = Person.model_json_schema()
    ids = torch.tensor([tok("Describe a person:")["input_ids"]] * 2)
    rows = [grammars.constraint("json", schema, "p") for _ in range(2)]
    out = generator.generate(ids, max_new_tokens=200, do_sample=True, constraint=rows)
    texts = {tok.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out}
    for text in texts:
        assert errors(json.loads(text), schema) == [], text
    assert all(c.done() for c in rows)
