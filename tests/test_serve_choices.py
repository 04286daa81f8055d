"""``n`` choices and a prompt's own logprobs over HTTP (the engine's, written once),
on test_serve's file, against the eager transformers model it was built from (fp32).

``echo`` with ``logprobs`` and ``max_tokens: 0`` is what lm-eval's local-completions
loglikelihood sends; vLLM's ``prompt_logprobs`` carries ids and ranks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from test_serve import Server, _greedy, served_files  # noqa: E402

TEXT = "the cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def built(store: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return served_files(store, tmp_path_factory)  # test_serve's, built once per run


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Any:
    server = Server(built["path"])
    yield server
    server.stop()


def _eager(built: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """The model's own log-softmax at each position (eager transformers, fp32)."""
    with torch.no_grad():
        logits = built["model"](torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_n_choices_greedy_alike_seeded_reproducible_usage_counted(
    server: Server, built: dict[str, Any]
) -> None:
    client = server.client()
    greedy = client.completions.create(model="tiny", prompt=TEXT, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {_greedy(built, TEXT, 6)}
    assert greedy.usage.completion_tokens == 18
    assert greedy.usage.prompt_tokens == len(built["tokenizer"](TEXT)["input_ids"])

    def sampled() -> list[str]:
        body = dict(model="tiny", prompt=TEXT, max_tokens=8, temperature=1.0, seed=5, n=2)
        return [c.text for c in client.completions.create(**body).choices]

    first = sampled()
    assert sampled() == first and first[0] != first[1]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=4, temperature=0, n=2
    )
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 8
    stream = client.completions.create(
        model="tiny",
        prompt=TEXT,
        max_tokens=5,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = ["", ""]
    for c in chunks:
        for piece in c.choices:
            texts[piece.index] += piece.text
    assert texts == [_greedy(built, TEXT, 5)] * 2
    assert chunks[-1].usage.completion_tokens == 10
    status, answer = server.request(
        "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "n": 17}
    )
    assert status == 400 and answer["error"]["param"] == "n", answer
    assert "'n' must be 1 to 16" in answer["error"]["message"]


def test_echo_logprobs_are_the_models_log_softmax_as_lm_eval_reads_them(
    server: Server, built: dict[str, Any]
) -> None:
    """lm-eval's loglikelihood request: the prompt's tokens, each one's logprob after
    those before it (the first None), its top alternatives and offsets."""
    ids = built["tokenizer"](TEXT)["input_ids"]
    eager = _eager(built, ids)
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, answer = server.request("POST", "/v1/completions", {**body, "temperature": 0})
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["text"] == TEXT and answer["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    want = [float(eager[j - 1, ids[j]]) for j in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for j in range(1, len(ids)):  # the top alternative is the model's argmax
        ((_, best),) = lp["top_logprobs"][j].items()
        assert best == pytest.approx(float(eager[j - 1].max()), abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # With new tokens: the prompt, then the greedy answer, logprobs for all of them.
    status, more = server.request(
        "POST", "/v1/completions", {**body, "max_tokens": 3, "temperature": 0}
    )
    assert status == 200, more
    (choice,) = more["choices"]
    assert choice["text"] == TEXT + _greedy(built, TEXT, 3)
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 3
    assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)


def test_vllm_prompt_logprobs_carry_ids_ranks_and_alternatives(
    server: Server, built: dict[str, Any]
) -> None:
    ids = built["tokenizer"](TEXT)["input_ids"]
    eager = _eager(built, ids)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2}
    status, answer = server.request("POST", "/v1/completions", {**body, "temperature": 0})
    assert status == 200, answer
    got = answer["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        row = eager[j - 1]
        mine = got[j][str(ids[j])]
        assert mine["logprob"] == pytest.approx(float(row[ids[j]]), abs=1e-4)
        assert mine["rank"] == int((row > row[ids[j]]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert set(got[j]) == {str(ids[j]), *map(str, top)}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    status, answer = server.request("POST", "/v1/chat/completions", {**chat, "prompt_logprobs": 0})
    assert status == 200 and answer["choices"][0]["prompt_logprobs"][0] is None, answer
    (first, *_) = _streamed(server, {**body, "temperature": 0})
    assert first["choices"][0]["prompt_logprobs"] == got  # streamed: in the first chunk


def _streamed(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's chunks, ``[DONE]`` checked and left out."""
    status, raw = server.request("POST", "/v1/completions", {**body, "stream": True})
    assert status == 200, raw
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def test_echo_streamed_adds_up_to_the_whole_answer(server: Server) -> None:
    """``echo`` with ``logprobs``, streamed: the prompt's text and tokens come first
    (as vLLM's), and the chunks add up to the whole answer: text, tokens, logprobs,
    offsets."""
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 3, "echo": True, "logprobs": 1}
    body["temperature"] = 0
    status, whole = server.request("POST", "/v1/completions", body)
    assert status == 200, whole
    want = whole["choices"][0]
    chunks = [c["choices"][0] for c in _streamed(server, body) if c["choices"]]
    assert chunks[0]["text"] == TEXT
    assert "".join(c["text"] for c in chunks) == want["text"]
    for key in ("tokens", "text_offset"):
        assert [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]] == want["logprobs"][
            key
        ]
    got = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert got[0] is None and got[1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:])


def test_a_list_of_prompts_as_lm_eval_batches_them(server: Server, built: dict[str, Any]) -> None:
    """lm-eval's local-completions with ``--batch_size 3`` sends its prompts as one list
    (these are its bodies, as it sends them): each prompt is answered as it is alone,
    prompt ``i``'s choice ``j`` at index ``i * n + j``, the usage summed."""
    texts = [TEXT, "the dog sat", "a mat and the cat sat on"]
    scored = {"model": "tiny", "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    scored["echo"] = True
    ids = [built["tokenizer"](t)["input_ids"] for t in texts]
    for prompts in (texts, ids):  # tokenized_requests=False, then True
        status, batch = server.request("POST", "/v1/completions", {**scored, "prompt": prompts})
        assert status == 200, batch
        assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
        for prompt, got, tokens in zip(prompts, batch["choices"], ids, strict=True):
            status, alone = server.request("POST", "/v1/completions", {**scored, "prompt": prompt})
            assert status == 200, alone
            want = alone["choices"][0]
            assert got["text"] == want["text"]
            assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(
                want["logprobs"]["token_logprobs"][1:], abs=1e-4
            )  # beside other slots' steps: another batch's summation order
            eager = _eager(built, tokens)
            first = [float(eager[j - 1, tokens[j]]) for j in range(1, len(tokens))]
            assert got["logprobs"]["token_logprobs"][1 : len(tokens)] == pytest.approx(
                first, abs=1e-4
            )
        assert batch["usage"]["prompt_tokens"] == sum(map(len, ids))
        assert batch["usage"]["completion_tokens"] == 3
    # generate_until's body: greedy, its stop string, n 2 for the index order.
    gen = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    alone = [server.request("POST", "/v1/completions", {**gen, "prompt": t})[1] for t in texts]
    for t, answer in zip(texts, alone, strict=True):
        assert answer["choices"][0]["text"] == _greedy(built, t, 6).split("\n\n")[0], answer
    status, batch = server.request("POST", "/v1/completions", {**gen, "prompt": texts, "n": 2})
    assert status == 200, batch
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    want = [a["choices"][0]["text"] for a in alone for _ in "ij"]
    assert [c["text"] for c in batch["choices"]] == want
    assert batch["usage"]["completion_tokens"] == 2 * sum(
        a["usage"]["completion_tokens"] for a in alone
    )
    status, answer = server.request(
        "POST", "/v1/completions", {**gen, "prompt": texts, "stream": True}
    )
    assert status == 400 and answer["error"]["param"] == "stream", answer
    status, answer = server.request("POST", "/v1/completions", {**gen, "prompt": [TEXT, [5, 6]]})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    far = {**gen, "prompt": [[5, 6], [10**9]]}  # the second prompt's id is past the vocabulary
    status, answer = server.request("POST", "/v1/completions", far)
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert server.request("GET", "/health")[1]["busy"] == 0  # the first prompt never ran
