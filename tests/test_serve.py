"""``torch-precompile serve``: the real server in a subprocess, spoken to as OpenAI's API.

One tiny Llama generator (2 layers, width 64, the 320-token BPE of
test_generator, 16 slots) is built once; the server runs in a fresh process
where transformers cannot be imported, on 127.0.0.1 at a free port. Clients:
the official ``openai`` package and raw HTTP (``http.client``). Greedy
outputs are compared with ``Generator.generate`` (itself equal to
transformers' ``generate``, tests/test_generator.py), alone and beside 15
other requests.
"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from conftest import ROOT  # noqa: E402
from test_generator import SMALL, _tokenizer  # noqa: E402

from torch_precompile import Precompile  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402
from torch_precompile.generation.compile import _cache_layout, _Step  # noqa: E402
from torch_precompile.generation.slots import slots_work  # noqa: E402
from torch_precompile.runtime.generator import Generator  # noqa: E402
from torch_precompile.runtime.generator_spec import GeneratorSpec  # noqa: E402
from torch_precompile_cli.lean_torch import DEFERRED  # noqa: E402

SLOTS, MAX_LENGTH, VOCAB = 16, 96, 320
TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)

# The server's process, started as the torch-precompile script starts it; transformers
# not importable; on exit, what it imported and which of torch's submodules it deferred
# never ran.
_SERVER = """
import sys
sys.modules["transformers"] = None
from torch_precompile_cli import main
from torch_precompile_cli.lean_torch import DEFERRED, _Deferred
code = main(sys.argv[1:])
imported = [
    m for m in ("transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
    if sys.modules.get(m) is not None
]
print("IMPORTED", imported, file=sys.stderr, flush=True)
deferred = [m for m in DEFERRED if isinstance(sys.modules.get(m), _Deferred)]
print("DEFERRED", deferred, file=sys.stderr, flush=True)
sys.exit(code)
"""


class Server:
    """A ``serve`` process on a free port, and raw HTTP to it."""

    def __init__(
        self,
        path: Path,
        *args: str,
        module: bool = False,
        root: Path = ROOT,
        script: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        head = ["-m", "torch_precompile"] if module else ["-c", script or _SERVER]
        command = [sys.executable, *head, "serve", str(path), "--port", str(self.port), *args]
        env = env if env is not None else dict(os.environ, PYTHONPATH=str(root))
        self.log = path.with_name(f"{path.stem}-{self.port}.log")
        with self.log.open("w") as log:  # a file, not a pipe: a full pipe would block it
            self.proc = subprocess.Popen(command, env=env, stderr=log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the server did not answer /health within 120 s")

    def request(self, method: str, route: str, body: Any = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, route, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            ctype = response.getheader("Content-Type", "")
            return response.status, json.loads(raw) if "json" in ctype else raw.decode()
        finally:
            conn.close()

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health")[1]

    def stream_gaps(
        self, body: dict[str, Any], gaps: list[tuple[float, float]], stop: threading.Event
    ) -> None:
        """Stream ``body``'s completion again and again until ``stop``, each gap between
        two events appended to ``gaps`` as (gap, when it ended)."""
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            last = time.perf_counter()
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            while line := response.readline():
                if line.startswith(b"data: "):
                    now = time.perf_counter()
                    gaps.append((now - last, now))
                    last = now
            conn.close()

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.log.read_text()


def _served_model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_key_value_heads=2, **{**SMALL, "vocab_size": VOCAB})
    return transformers.LlamaForCausalLM(config).eval()


def _build_served(root: Path, template: str) -> None:
    """The served files: tiny.pt, and two of the same step with other specs."""
    tokenizer = _tokenizer()
    tokenizer.chat_template = template
    generator = compile_generator(
        _served_model(), max_batch=SLOTS, max_length=MAX_LENGTH, tokenizer=tokenizer
    )
    assert generator.spec.slots and generator.spec.chat_template == template
    Precompile.save(root / "tiny.pt", generator)
    # The same step, 2 slots and no chat template: a queue to fill, a chat to refuse.
    small = dataclasses.replace(generator.spec, max_batch=2, chat_template=None)
    Precompile.save(root / "small.pt", Generator(generator.step, small, generator.tokenizer_json))
    # The same step where the model's generation_config set sampling settings.
    own = dataclasses.replace(
        generator.spec,
        sampling=(("temperature", 0.8), ("top_k", 1)),
        lengths=(("max_new_tokens", 5),),
    )
    Precompile.save(root / "own.pt", Generator(generator.step, own, generator.tokenizer_json))


def served_files(
    store: Any, tmp_path_factory: pytest.TempPathFactory, template: str = TEMPLATE
) -> dict[str, Any]:
    """The served files with this chat ``template``, built once per run for each
    (tests/fixtures/store.py), copied into the calling module's own folder (a server's
    log is written beside its file)."""
    key = {"small": SMALL, "vocab": VOCAB, "slots": SLOTS, "max_length": MAX_LENGTH}
    build = functools.partial(_build_served, template=template)
    shared = store.saved("serve-llama", {**key, "template": template}, build, folder=True)
    root = tmp_path_factory.mktemp("serve")
    for name in ("tiny.pt", "small.pt", "own.pt"):
        shutil.copyfile(shared / name, root / name)
    tokenizer = _tokenizer()
    tokenizer.chat_template = template
    return {
        "path": root / "tiny.pt",
        "small": root / "small.pt",
        "own": root / "own.pt",
        "tokenizer": tokenizer,
        "model": _served_model(),
    }


@pytest.fixture(scope="module")
def built(store: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return served_files(store, tmp_path_factory)


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Any:
    server = Server(built["path"])
    yield server
    server.stop()


def _greedy(built: dict[str, Any], text: str, new: int) -> str:
    """``Generator.generate``'s greedy continuation of ``text`` (transformers' own)."""
    tokenizer = built["tokenizer"]
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    out = Precompile.load(built["path"]).generate(ids, max_new_tokens=new)
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


PROMPTS = [("the cat sat on the mat " * 4)[: 3 + 5 * i] for i in range(SLOTS)]


def test_completion_and_chat_with_the_openai_client(server: Server, built: dict[str, Any]) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=0)
    assert out.choices[0].text == _greedy(built, PROMPTS[3], 12)
    assert out.usage.prompt_tokens == len(built["tokenizer"](PROMPTS[3])["input_ids"])
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    # Token ids in; logprobs: the chosen token's is the largest of its top 3.
    ids = built["tokenizer"](PROMPTS[3])["input_ids"]
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=12, temperature=0, logprobs=3
    )
    assert by_ids.choices[0].text == out.choices[0].text
    lp = by_ids.choices[0].logprobs
    # (OpenAI's dict of alternatives: two tokens that decode alike are one entry)
    assert len(lp.token_logprobs) == 12 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(abs(max(t.values()) - x) < 1e-5 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    # ... and each is the model's own: generate's logits of that step, log-softmaxed.
    ran = Precompile.load(built["path"]).generate(
        torch.tensor([ids]), max_new_tokens=12, return_dict_in_generate=True, output_logits=True
    )
    new = ran.sequences[0, len(ids) :].tolist()
    want = [float(step[0].log_softmax(-1)[t]) for step, t in zip(ran.logits, new)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    # Chat: the saved template rendered by the server, as transformers renders it.
    messages = [{"role": "user", "content": "the cat"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    rendered = built["tokenizer"].apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert chat.choices[0].message.content == _greedy(built, rendered, 8)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    assert chat.usage.prompt_tokens == len(built["tokenizer"](rendered)["input_ids"])


def test_streams_end_with_done_and_equal_the_whole_answer(server: Server) -> None:
    client = server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=10, temperature=0)
    pieces = client.completions.create(
        model="tiny",
        prompt=PROMPTS[5],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in chat]
    assert deltas[0].role == "assistant" and len(deltas) >= 2
    # Raw SSE: every event a data line, the last one [DONE].
    status, text = server.request(
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "the", "max_tokens": 3, "temperature": 0, "stream": True},
    )
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]", text
    assert all(e.startswith("data: {") for e in events[:-1])


def test_sixteen_concurrent_clients_each_equal_to_its_solo_run(server: Server) -> None:
    client = server.client()

    def ask(prompt: str) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=14, temperature=0)
        return out.choices[0].text

    solo = [ask(p) for p in PROMPTS]
    together: list[str | None] = [None] * SLOTS
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, ask(PROMPTS[i])))
        for i in range(SLOTS)
    ]
    for t in threads:  # staggered: requests join while others decode
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join(120)
    assert together == solo
    assert len(set(solo)) > 4  # different prompts, different answers
    # Sampling with a seed: the same tokens again, beside others or not.
    seeded = [
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=10,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 40},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_a_client_that_leaves_mid_stream_frees_its_slot(server: Server) -> None:
    before = server.health()["cancelled"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": "tiny", "prompt": [5], "max_tokens": MAX_LENGTH - 1, "stream": True}
    body["ignore_eos"] = True
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.read(6) == b"data: "  # generating
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = server.health()
        if health["busy"] == 0:
            break
        time.sleep(0.02)
    assert health["busy"] == 0 and health["cancelled"] == before + 1, health


BAD = [
    (b"{not json", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"prompt": "a"}, 400, "'model' is required"),
    ({"model": "tiny"}, 400, "'prompt' is required"),
    ({"model": "tiny", "prompt": {"a": 1}}, 400, "'prompt' must be"),
    ({"model": "tiny", "prompt": "a", "max_tokens": "ten"}, 400, "'max_tokens' must be int"),
    ({"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "1 or more"),
    ({"model": "tiny", "prompt": "a", "max_tokens": MAX_LENGTH}, 400, "max_length=96"),
    ({"model": "tiny", "prompt": [3] * MAX_LENGTH}, 400, "max_length=96"),
    ({"model": "tiny", "prompt": [VOCAB]}, 400, "past the vocabulary"),
    ({"model": "tiny", "prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "a", "n": SLOTS + 1}, 400, "'n' must be 1 to 16"),
    ({"model": "tiny", "prompt": "a", "logprobs": 9}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "a", "stop": 5}, 400, "stop"),
    ({"model": "tiny", "prompt": "a", "stream": "yes"}, 400, "'stream' must be bool"),
    ({"model": "tiny", "prompt": "a", "presence_penalty": 2.5}, 400, "'presence_penalty' must"),
    ({"model": "tiny", "prompt": "a", "frequency_penalty": "1"}, 400, "'frequency_penalty' must"),
    ({"model": "tiny", "prompt": "a", "repetition_penalty": 0}, 400, "'repetition_penalty'"),
    ({"model": "tiny", "prompt": "a", "logit_bias": {"x": 1}}, 400, "keys must be token ids"),
    ({"model": "tiny", "prompt": "a", "logit_bias": {"5": 101}}, 400, "in [-100, 100]"),
    ({"model": "tiny", "prompt": "a", "logit_bias": {"5": True}}, 400, "in [-100, 100]"),
    ({"model": "tiny", "prompt": "a", "logit_bias": {str(VOCAB): 1}}, 400, "past the vocabulary"),
    ({"model": "tiny", "prompt": "a", "logit_bias": [5]}, 400, "'logit_bias' must be dict"),
    ({"model": "tiny", "prompt": "a", "min_tokens": 4}, 400, "'min_tokens' is not supported"),
    ({"model": "tiny", "prompt": "a", "min_p": 1.5}, 400, "'min_p' must be in [0, 1]"),
    ({"model": "tiny", "prompt": "a", "allowed_token_ids": [1]}, 400, "'allowed_token_ids' is not"),
    (
        {"model": "tiny", "prompt": "a", "response_format": {"type": "xml"}},
        400,
        "'response_format' 'xml' is not one of",
    ),
    (
        {"model": "tiny", "prompt": "a", "structured_outputs": {"grammar": "x"}},
        400,
        "not a valid grammar",
    ),
    ({"model": "tiny", "prompt": "a", "guided_regex": "a", "guided_choice": ["a"]}, 400, "one of"),
    ({"model": "other", "prompt": "a"}, 404, "does not exist"),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(
    server: Server, body: Any, status: int, words: str
) -> None:
    got, answer = server.request("POST", "/v1/completions", body)
    assert got == status, answer
    assert words in answer["error"]["message"], answer
    kind = {400: "invalid_request_error", 404: "invalid_request_error"}[status]
    assert answer["error"]["type"] == kind, answer
    assert answer["error"]["param"] or not isinstance(body, dict), answer  # the field named
    chat = {"model": "tiny", "messages": [{"role": "user"}], "max_tokens": 2, "temperature": 0}
    assert server.request("POST", "/v1/chat/completions", {**chat, "messages": "hi"})[0] == 400
    assert server.request("GET", "/v1/nowhere")[1]["error"]["code"] == "not_found"
    assert server.request("GET", "/v1/completions")[0] == 405
    assert server.request("POST", "/v1/chat/completions", chat)[0] == 200


class _OpenAIPenalties(transformers.LogitsProcessor):
    """The reference for OpenAI's presence and frequency penalties: each token's logit
    less ``frequency * count + presence * (count > 0)``, counted in the output alone."""

    def __init__(self, prompt: int, frequency: float, presence: float) -> None:
        self.prompt, self.frequency, self.presence = prompt, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[:, self.prompt :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, new, torch.ones_like(new, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def test_logit_bias_and_penalties_equal_transformers_processors(
    server: Server, built: dict[str, Any]
) -> None:
    """Greedy answers under each penalty, asked at once through the openai package, equal
    transformers' generate with its own processors (the bias and the repetition penalty)
    or the formula's (presence and frequency): each request keeps its own counts."""
    model, new = built["model"], 24
    prompt = built["tokenizer"]("the cat sat on the mat the cat")["input_ids"]
    ids = torch.tensor([prompt])

    def reference(**settings: Any) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                **settings,
            )
        return out[0, len(prompt) :].tolist()

    plain = reference()
    bias = {plain[0]: -100.0, plain[2]: 4.0}
    cases = {
        "repetition": ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
        "bias": (
            {"logit_bias": {str(t): b for t, b in bias.items()}},
            {"sequence_bias": {(t,): b for t, b in bias.items()}},
        ),
        # Negative: the output repeats, so a count of 2 tells frequency from presence.
        "frequency": (
            {"frequency_penalty": -1.0},
            {
                "logits_processor": transformers.LogitsProcessorList(
                    [_OpenAIPenalties(len(prompt), frequency=-1.0, presence=0.0)]
                )
            },
        ),
        "presence": (
            {"presence_penalty": -1.0},
            {
                "logits_processor": transformers.LogitsProcessorList(
                    [_OpenAIPenalties(len(prompt), frequency=0.0, presence=-1.0)]
                )
            },
        ),
        "all": (
            {
                "frequency_penalty": 1.5,
                "presence_penalty": 0.75,
                "logit_bias": {str(t): b for t, b in bias.items()},
                "extra_body": {"repetition_penalty": 1.8},
            },
            {
                "repetition_penalty": 1.8,
                "sequence_bias": {(t,): b for t, b in bias.items()},
                "logits_processor": transformers.LogitsProcessorList(
                    [_OpenAIPenalties(len(prompt), frequency=1.5, presence=0.75)]
                ),
            },
        ),
    }
    expected = {name: reference(**hf) for name, (_, hf) in cases.items()}
    assert all(tokens != plain for tokens in expected.values()), (plain, expected)
    assert expected["frequency"] != expected["presence"], expected
    client, got = server.client(), {}

    def ask(name: str) -> None:
        ours = cases[name][0]
        extra = {"return_token_ids": True, **ours.get("extra_body", {})}
        answer = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=new,
            temperature=0,
            **{k: v for k, v in ours.items() if k != "extra_body"},
            extra_body=extra,
        )
        got[name] = answer.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=ask, args=(name,)) for name in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected


def test_stop_token_ids_end_the_answer_at_the_first_of_them(server: Server) -> None:
    """vLLM's stop_token_ids: the answer ends with the first of them, finish_reason
    stop, even beside ignore_eos; an id past the vocabulary is refused."""
    body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 12, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True)
    free = server.request("POST", "/v1/completions", body)[1]["choices"][0]
    stops = [free["token_ids"][5], VOCAB - 1]
    ends = [i for i, t in enumerate(free["token_ids"]) if t in stops]
    cut = free["token_ids"][: ends[0] + 1]
    assert len(cut) < 12, free
    got = server.request("POST", "/v1/completions", {**body, "stop_token_ids": stops})
    assert (
        got[1]["choices"][0]["token_ids"] == cut and got[1]["choices"][0]["finish_reason"] == "stop"
    )
    assert got[1]["usage"]["completion_tokens"] == len(cut)
    for bad in ([VOCAB], [-1], "5"):
        status, answer = server.request("POST", "/v1/completions", {**body, "stop_token_ids": bad})
        assert status == 400 and answer["error"]["param"] == "stop_token_ids", answer


def test_a_field_the_server_does_not_read_is_named_in_its_log(server: Server) -> None:
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2, "temperature": 0}
    assert server.request("POST", "/v1/completions", {**body, "frobnicate": 1})[0] == 200
    assert server.request("POST", "/v1/completions", {**body, "user": "u1"})[0] == 200
    deadline = time.monotonic() + 10
    while "frobnicate" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log.read_text()
    assert "does not read, ignored: ['frobnicate']" in log and "'user'" not in log, log[-2000:]


def test_chat_logprobs_bytes_are_each_tokens_own(server: Server) -> None:
    """OpenAI's logprobs ``bytes``: the token's own bytes, so a client can join the
    pieces of a character split between tokens (a token's text alone is U+FFFD)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "héllo wörld"}]}
    body.update(max_tokens=24, temperature=1.0, seed=7, logprobs=True, top_logprobs=2)
    body.update(ignore_eos=True, return_token_ids=True)
    answer = server.request("POST", "/v1/chat/completions", body)[1]["choices"][0]
    content, ids = answer["logprobs"]["content"], answer["token_ids"]
    kept = [bytes(c["bytes"]) for c, i in zip(content, ids) if i > 2]  # 0-2: special
    assert b"".join(kept).decode(errors="replace") == answer["message"]["content"]
    split = [c for c in content if c["token"] == "\ufffd"]
    assert split and all(bytes(c["bytes"]) != "\ufffd".encode() for c in split), content
    for c in content:
        assert all(
            bytes(t["bytes"]).decode(errors="replace") == t["token"] or t["token"] == "\ufffd"
            for t in c["top_logprobs"]
        )


def test_a_sampled_request_follows_its_logit_bias(server: Server) -> None:
    """Sampling draws from the biased distribution: +100 on one token takes every draw,
    where the same seed without the bias draws others."""
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 8, "temperature": 1.0}
    body.update(seed=3, ignore_eos=True, return_token_ids=True)
    free = server.request("POST", "/v1/completions", body)[1]["choices"][0]["token_ids"]
    assert len(set(free)) > 1, free
    biased = {**body, "logit_bias": {"17": 100}}
    assert (
        server.request("POST", "/v1/completions", biased)[1]["choices"][0]["token_ids"] == [17] * 8
    )


def test_the_models_sampling_settings_fill_what_a_request_leaves_out(
    server: Server, built: dict[str, Any]
) -> None:
    """As vLLM's server: settings the file recorded from the model's generation_config
    (here top_k 1, max_new_tokens 5) are a request's defaults; a request's own
    settings win. min_p 1 keeps only the likeliest token. A chat that leaves out
    max_tokens runs to the model's max_new_tokens (to the cache's end without one),
    a completion to OpenAI's 16."""
    own = Server(built["own"])
    try:
        body = {"prompt": "the cat sat", "max_tokens": 12, "seed": 3, "ignore_eos": True}
        body["return_token_ids"] = True

        def ids(where: Server, **extra: Any) -> list[int]:
            name = "own" if where is own else "tiny"
            answer = where.request("POST", "/v1/completions", {**body, "model": name, **extra})
            return answer[1]["choices"][0]["token_ids"]

        greedy = ids(own, temperature=0)
        assert ids(own) == greedy  # sampled, at the file's top_k 1
        plain = ids(server)  # the same request to a file without settings: sampled at 1.0
        assert plain != greedy
        assert ids(own, temperature=1.0, top_k=-1) == plain
        assert ids(server, min_p=1.0) == greedy

        def lengths(where: Server, path: str, **extra: Any) -> tuple[int, int]:
            name = "own" if where is own else "tiny"
            ask = {"model": name, "ignore_eos": True, "temperature": 0, **extra}
            status, answer = where.request("POST", path, ask)
            assert status == 200, answer
            return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]

        chat = {"messages": [{"role": "user", "content": "the cat"}]}
        assert lengths(own, "/v1/chat/completions", **chat)[1] == 5
        assert lengths(own, "/v1/chat/completions", **chat, max_tokens=7)[1] == 7
        assert lengths(own, "/v1/completions", prompt="the cat")[1] == 16
        prompt, new = lengths(server, "/v1/chat/completions", **chat)
        assert new == MAX_LENGTH - prompt > 16
    finally:
        log = own.stop()
    assert "the model's sampling settings" in log and "'top_k': 1" in log, log
    assert "'max_tokens': 5" in log, log
    shown = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", str(built["own"])],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    want = "sampling defaults (the model's generation_config): temperature 0.8, top_k 1"
    assert want in shown.stdout, shown.stdout + shown.stderr


def test_two_hundred_requests_no_memory_growth_no_lost_slot(server: Server) -> None:
    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": PROMPTS[i % SLOTS], "max_tokens": 3, "temperature": 0}
        body["stream"] = i % 2 == 0
        assert server.request("POST", "/v1/completions", body)[0] == 200

    for i in range(50):
        one(i)
    start = server.rss_kib()
    for i in range(150):
        one(i)
    grown = server.rss_kib() - start
    assert grown < 8 * 1024, f"the server grew {grown} KiB over 150 requests"
    assert server.health() | {"cancelled": 0} == {
        "status": "ok",
        "slots": SLOTS,
        "busy": 0,
        "queued": 0,
        "cancelled": 0,
    }


def test_the_package_installed_elsewhere_serves_the_same_file(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """A file built here, served by the package at another path (another machine's
    virtual environment): nothing in the file may name this checkout's paths. (The
    identity guards that compared a function's file path were checked on the H100's
    full guard path, not this CPU's lean one: test_guards tests them directly.)"""
    import shutil

    shutil.copytree(ROOT / "torch_precompile", tmp_path / "torch_precompile")
    elsewhere = Server(built["path"], root=tmp_path)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0}
        status, answer = elsewhere.request("POST", "/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == _greedy(built, PROMPTS[5], 8)
    finally:
        elsewhere.stop()


def test_a_full_queue_is_503_a_chat_without_template_400(built: dict[str, Any]) -> None:
    small = Server(built["small"], "--max-queue", "1", "--model-name", "s", module=True)
    try:
        body = {"model": "s", "prompt": [5], "max_tokens": MAX_LENGTH - 1, "ignore_eos": True}
        statuses: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: statuses.append(small.request("POST", "/v1/completions", body)[0])
            )
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # 2 slots and 1 place in the queue: the others are turned away, none lost.
        assert sorted(statuses)[0] == 200 and 503 in statuses, statuses
        assert set(statuses) == {200, 503}
        chat = {"model": "s", "messages": [{"role": "user", "content": "a"}]}
        status, answer = small.request("POST", "/v1/chat/completions", chat)
        assert status == 400 and "no chat template" in answer["error"]["message"]
        assert small.health()["busy"] == 0
    finally:
        small.stop()


def test_the_engine_gives_each_row_generates_logprobs_at_every_batch(
    built: dict[str, Any],
) -> None:
    """The engine alone, on the file from disk: a step runs on as many rows as the
    highest busy slot needs (2, 4, 8 or 16). Three waves (1, then 3, then 16 requests,
    the later ones in higher slots ending first) make the steps run at every batch,
    shrink as the top slots free, and refill slots whose cache holds an earlier run's
    entries past their own index. Every request's tokens and each token's
    log-probability equal ``generate``'s for its prompt alone (fp32)."""
    from torch_precompile.engine.requests import Delta, Event
    from torch_precompile.serve.engine import Engine
    from torch_precompile.serve.protocol import Job

    gen = Precompile.load(built["path"])
    waves = [[(5, 9)], [(3, 6), (8, 11), (2, 4)], [(2 + i % 9, 20 - i) for i in range(16)]]
    expected: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
    for w, wave in enumerate(waves):
        for r, (length, new) in enumerate(wave):
            prompt = [(7 * (w + r) + 3 * k) % 300 + 10 for k in range(length)]
            ran = gen.generate(
                torch.tensor([prompt]),
                max_new_tokens=new,
                eos_token_id=None,
                return_dict_in_generate=True,
                output_logits=True,
            )
            tokens = ran.sequences[0, length:].tolist()
            steps = [step[0].float().log_softmax(-1) for step in ran.logits]
            expected[w, r] = tokens, [float(d[t]) for d, t in zip(steps, tokens)]
    engine = Engine(gen, max_queue=32)
    engine.warm()
    seen: set[int] = set()
    decode = engine._decode_logits
    engine._decode_logits = lambda batch: seen.add(batch) or decode(batch)  # type: ignore[method-assign]
    stepping = threading.Thread(target=engine.run)
    stepping.start()
    got: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
    try:
        for w, wave in enumerate(waves):
            done = [threading.Event() for _ in wave]
            for r, (length, new) in enumerate(wave):
                prompt = [(7 * (w + r) + 3 * k) % 300 + 10 for k in range(length)]
                got[w, r] = ([], [])

                def sink(event: Event, key: tuple[int, int] = (w, r), ends=done) -> None:
                    assert isinstance(event, Delta), event
                    got[key][0].extend(event.token_ids)
                    got[key][1].extend(e.logprob for e in event.logprobs)
                    if event.finish is not None:
                        ends[key[1]].set()

                job = Job(False, "m", prompt, new, temperature=0, logprobs=1, ignore_eos=True)
                engine.open(job, sink)
            assert all(d.wait(120) for d in done), engine.load()
    finally:
        engine.stop()
        stepping.join(60)
    assert seen == {1, 2, 4, 8, 16}, seen  # the first wave's one run alone: one row
    # fp32: a step of 16 rows sums in another order than generate's one row (measured up
    # to 1.5e-5 apart after 20 steps); a wrong row or step is off by tenths or units.
    for key, (tokens, logprobs) in expected.items():
        assert got[key][0] == tokens, key
        assert got[key][1] == pytest.approx(logprobs, abs=1e-4), key


def test_the_engine_prefills_outside_cuda_graphs(built: dict[str, Any]) -> None:
    """Each prompt length is another layout of the prefill, which reduce-overhead would
    record into a CUDA graph with its own memory (lean/cudagraphs.py): the engine
    prefills in ``not_recorded``, and its logits are ``generate``'s first step's."""
    from torch_precompile.lean import cudagraphs
    from torch_precompile.serve.engine import Engine

    gen = Precompile.load(built["path"])
    engine = Engine(gen, max_queue=4)
    step, flags = engine.step, []
    engine.step = lambda *a: flags.append(cudagraphs._NOT_RECORDED.get()) or step(*a)  # type: ignore[method-assign]
    prompt = [11, 42, 7, 300, 5]
    with torch.no_grad():  # as the engine's loop runs it
        logits = engine._prefill_logits(0, prompt)
    want = gen.generate(
        torch.tensor([prompt]), max_new_tokens=1, return_dict_in_generate=True, output_logits=True
    )
    assert flags == [True]
    torch.testing.assert_close(logits, want.logits[0].float(), rtol=1e-5, atol=1e-5)


def test_sigterm_ends_it_with_status_0_and_a_taken_port_with_1(built: dict[str, Any]) -> None:
    """SIGTERM (a container's stop) ends the server cleanly; a second server on the same
    port says it cannot listen and exits 1, rather than loading and serving nothing."""
    first = Server(built["small"], module=True)
    try:
        command = [sys.executable, "-m", "torch_precompile", "serve", str(built["small"])]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        second = subprocess.run(
            [*command, "--port", str(first.port)], env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert second.returncode == 1, second.stderr
        assert f"could not listen on 127.0.0.1:{first.port}" in second.stderr, second.stderr
        assert first.health()["status"] == "ok"
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=30) == 0, first.log.read_text()
    finally:
        first.stop()


_BROKEN_ENGINE = """
import sys
from torch_precompile.serve import engine
def broken(self):
    raise RuntimeError("a fault in the engine's loop")
engine.Engine._loop = broken
from torch_precompile.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_dies_ends_the_server_rather_than_leaving_http_up(
    built: dict[str, Any],
) -> None:
    """The engine steps on the main thread and HTTP on another: a fault that ends the
    engine must end the process (status 1, the fault named), not leave a server that
    accepts requests no one will answer (it hung until killed before)."""
    command = [sys.executable, "-c", _BROKEN_ENGINE, "serve", str(built["small"]), "--port", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "a fault in the engine's loop" in proc.stderr, proc.stderr


def test_the_server_imported_neither_transformers_nor_the_compiler(server: Server) -> None:
    assert server.request("GET", "/health")[0] == 200
    err = server.stop()
    assert "IMPORTED []" in err, err
    # The four submodules import torch runs for a compiler stayed unrun through every
    # request this module's tests sent (tests/test_lean_torch.py: what running them does).
    assert f"DEFERRED {list(DEFERRED)}" in err, err


def test_a_file_without_the_slot_step_is_refused_and_older_records_read(
    built: dict[str, Any],
) -> None:
    loaded = Precompile.load(built["path"])
    record = loaded.spec.to_json()
    for key in ("slots", "chat_template", "chat_tokens"):  # a record from before serve
        del record[key]
    old = GeneratorSpec.from_json(record, "old")
    assert (old.slots, old.chat_template, old.chat_tokens) == (False, None, ())
    path = built["path"].with_name("noslots.pt")
    Precompile.save(path, Generator(loaded.step, old, loaded.tokenizer_json))
    command = [sys.executable, "-m", "torch_precompile", "serve", str(path), "--port", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "no slot decode step" in proc.stderr, proc.stderr
    assert "Bloom" in proc.stderr and "build it again" in proc.stderr


SLOT_FAMILIES = {
    # A window shorter than the check's prompt; full and sliding layers mixed.
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(num_key_value_heads=2, sliding_window=12, **SMALL)
    ),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(num_key_value_heads=1, head_dim=16, sliding_window=12, **SMALL)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
    ),
    "bloom": lambda: transformers.BloomForCausalLM(
        transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=1000)
    ),
}


@pytest.mark.parametrize("name", sorted(SLOT_FAMILIES))
def test_the_build_checks_the_slot_step_eagerly(name: str) -> None:
    """The slot step's logits equal the shared step's (past a sliding window, with
    mixed layer types); ALiBi from a 2-D mask (Bloom) cannot take the per-row mask."""
    torch.manual_seed(0)
    model = SLOT_FAMILIES[name]().eval()
    shapes, dtype = _cache_layout(model, 40)
    refused = slots_work(_Step(model, 40).eval(), shapes, dtype)
    if name == "bloom":
        assert refused is not None
    else:
        assert refused is None, refused
