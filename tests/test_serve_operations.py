"""``torch-precompile serve``'s operations: ``/tokenize`` and ``/detokenize`` (vLLM's
shapes), ``/version``, Prometheus ``/metrics``, ``--api-key``, and the drain on SIGTERM.

One tiny Llama generator (test_serve's: 2 layers, width 64, 16 slots, its chat
template) is built once; each server runs where transformers cannot be imported
(test_serve's ``Server``). The tokenizer the file holds is compared with the one it
was built from, in transformers; metrics are read with prometheus-client's parser.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import signal
import time
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from test_serve import (  # noqa: E402
    _SERVER,
    MAX_LENGTH,
    PROMPTS,
    SLOTS,
    VOCAB,
    Server,
    served_files,
)

JSON = {"Content-Type": "application/json"}
_MARKER = 'sys.modules["transformers"] = None\n'


def _script(patch: str) -> str:
    """test_serve's server process with ``patch`` run first."""
    return _SERVER.replace(_MARKER, _MARKER + patch)


@pytest.fixture(scope="module")
def built(store: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return served_files(store, tmp_path_factory)  # test_serve's, built once per run


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Any:
    server = Server(built["path"])
    yield server
    server.stop()


def test_tokenize_and_detokenize_are_the_files_tokenizer(
    server: Server, built: dict[str, Any]
) -> None:
    tokenizer = built["tokenizer"]
    text = "the cat sat on héllo wörld"
    status, got = server.request("POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    ids = tokenizer(text)["input_ids"]
    assert status == 200, got
    assert got == {
        "count": len(ids),
        "max_model_len": MAX_LENGTH,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    status, back = server.request("POST", "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and back == {"prompt": text}, back
    special = [1, *ids[:3], 2]  # <bos> ... <eos>: kept, as vLLM's detokenize keeps them
    want = tokenizer.decode(special, skip_special_tokens=False)
    assert server.request("POST", "/detokenize", {"tokens": special})[1] == {"prompt": want}
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]
    for generation in (True, False):
        body = {"model": "tiny", "messages": messages, "add_generation_prompt": generation}
        status, chat = server.request("POST", "/tokenize", body)
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        assert status == 200, chat
        assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert chat["token_strs"] is None and chat["count"] == len(chat["tokens"])
    for route, body, status, param in (
        ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ):
        got_status, answer = server.request("POST", route, body)
        assert got_status == status and answer["error"]["param"] == param, answer


def test_version_is_the_installed_packages(server: Server) -> None:
    status, got = server.request("GET", "/version")
    assert status == 200 and got == {"version": importlib.metadata.version("torch_precompile")}


def _metrics(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus-client, by name and labels."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and "text/plain" in response.getheader("Content-Type")
    text = response.read().decode()
    conn.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_move_with_each_request(server: Server, built: dict[str, Any]) -> None:
    """Counters and histograms after a whole answer, a stream, and a stream whose
    client left: tokens counted, each finish by its reason, one time to first
    token per request, one inter-token latency per token after the first."""
    p = "torch_precompile_"
    before = _metrics(server)
    assert before[(p + "slots", ())] == SLOTS
    assert before[(p + "requests_running", ())] == 0 and before[(p + "slot_use", ())] == 0
    client = server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=6, temperature=0)
    assert whole.usage.completion_tokens == 6
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = list(chunks)[-1].usage
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # leaves mid-stream
    body = {"model": "tiny", "prompt": [5], "max_tokens": MAX_LENGTH - 1, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}), JSON)
    response = conn.getresponse()
    assert response.read(6) == b"data: "
    conn.close()
    deadline = time.monotonic() + 10
    while server.health()["busy"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _metrics(server)

    def moved(name: str, **labels: str) -> float:
        key = (p + name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    aborted = moved("generation_tokens_total") - 6 - 5
    assert 1 <= aborted < MAX_LENGTH - 1, aborted
    prompt = len(built["tokenizer"](PROMPTS[4])["input_ids"]) + streamed.prompt_tokens + 1
    assert moved("prompt_tokens_total") == prompt
    assert moved("requests_finished_total", finish_reason="length") == 2
    assert moved("requests_finished_total", finish_reason="abort") == 1
    assert moved("time_to_first_token_seconds_count") == 3
    assert moved("inter_token_latency_seconds_count") == 5 + 4 + aborted - 1
    assert moved("e2e_request_latency_seconds_count") == 3
    assert moved("time_to_first_token_seconds_sum") > 0
    assert moved("e2e_request_latency_seconds_sum") >= moved("time_to_first_token_seconds_sum")
    assert after[(p + "requests_running", ())] == 0


_NO_PROMETHEUS = 'sys.modules["prometheus_client"] = None\n'


def test_an_api_key_is_asked_of_every_route_but_health(built: dict[str, Any]) -> None:
    """--api-key: without it or with another, a 401 with OpenAI's body (the openai
    SDK raises AuthenticationError); /health stays open. This server cannot import
    prometheus-client: it serves, and its /metrics is a 501 saying what to install."""
    keyed = Server(built["path"], "--api-key", "s3cret", script=_script(_NO_PROMETHEUS))
    try:
        assert keyed.request("GET", "/health")[0] == 200
        status, answer = keyed.request("GET", "/v1/models")
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
        url = f"http://127.0.0.1:{keyed.port}/v1"
        with pytest.raises(openai.AuthenticationError, match="not this server's"):
            openai.OpenAI(base_url=url, api_key="wrong").models.list()
        client = openai.OpenAI(base_url=url, api_key="s3cret")
        out = client.completions.create(model="tiny", prompt="the cat", max_tokens=3)
        assert out.usage.completion_tokens == 3
        for route in ("/version", "/metrics"):
            assert keyed.request("GET", route)[0] == 401
        conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=30)
        conn.request("GET", "/metrics", headers={"Authorization": "Bearer s3cret"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == 501 and "prometheus-client" in answer["error"]["message"]
    finally:
        keyed.stop()


# Each decode step 30 ms longer: a stream of 90 tokens lasts ~3 s, long enough to
# send SIGTERM in its middle.
_SLOW = """
import time as _time
from torch_precompile.serve import engine as _engine
_decode = _engine.Engine._decode
def _slow(self):
    _time.sleep(0.03)
    _decode(self)
_engine.Engine._decode = _slow
"""


def test_sigterm_drains_running_streams_then_exits_0(built: dict[str, Any]) -> None:
    """SIGTERM: new requests and /health are 503s at once; the stream running finishes
    all its tokens; then the process exits with status 0."""
    slow = Server(built["path"], "--drain-timeout", "60", script=_script(_SLOW))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=60)
        body = {"model": "tiny", "prompt": [5], "max_tokens": 90, "stream": True}
        body.update(ignore_eos=True, return_token_ids=True)
        conn.request("POST", "/v1/completions", json.dumps(body), JSON)
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: {"), first
        assert _metrics(slow)[("torch_precompile_requests_running", ())] == 1
        slow.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while slow.request("GET", "/health")[0] != 503:
            assert time.monotonic() < deadline, "/health still answers 200 after SIGTERM"
            time.sleep(0.02)
        ask = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        status, answer = slow.request("POST", "/v1/completions", ask)
        assert status == 503 and "shutting down" in answer["error"]["message"], answer
        rest = response.read().decode()
        conn.close()
        events = [json.loads(e[6:]) for e in rest.splitlines() if e.startswith("data: {")]
        assert rest.endswith("data: [DONE]\n\n"), rest[-300:]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        got = [json.loads(first[6:]), *events]
        assert sum(len(e["choices"][0]["token_ids"]) for e in got) == 90
        assert slow.proc.wait(timeout=30) == 0
    finally:
        log = slow.stop()
    assert "serve: draining (SIGTERM)" in log, log  # (the count may hold a request just answered)
    assert "Traceback" not in log, log


def test_a_drain_past_its_timeout_stops_the_server_with_status_0(built: dict[str, Any]) -> None:
    """--drain-timeout 1 and a stream of ~3 s: the server stops after the timeout,
    cutting the stream, and exits 0; the drain says how many it left."""
    slow = Server(built["path"], "--drain-timeout", "1", script=_script(_SLOW))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=60)
        body = {"model": "tiny", "prompt": [5], "max_tokens": 90, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}), JSON)
        response = conn.getresponse()
        assert response.readline().startswith(b"data: {")
        slow.proc.send_signal(signal.SIGTERM)
        assert slow.proc.wait(timeout=30) == 0
        try:
            rest = response.read()
        except http.client.IncompleteRead as cut:
            rest = cut.partial
        conn.close()
        assert b"[DONE]" not in rest and b'"finish_reason": "length"' not in rest, rest[-300:]
        assert rest.count(b"data: {") < 80  # cut well before its 90 tokens
    finally:
        log = slow.stop()
    assert "--drain-timeout 1.0 s passed, 1 still open" in log, log
