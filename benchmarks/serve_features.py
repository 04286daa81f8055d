"""The server's features under load: structured output's cost a token, and batch invariance.

Serves a built generator file that holds a tokenizer (``serve.py --tokenizer DIR
--build-only`` makes one) in a fresh process where transformers cannot be
imported, and measures over raw HTTP:

1. ``structured``: for each ``C`` in ``--clients``, ``C`` streaming
   ``/v1/completions`` at once, greedy, ``--new-tokens`` each, first free
   (``plain``) then under a JSON schema (``response_format`` json_schema,
   strict). Each request's inter-token gaps (one token an event) give p50, p99
   and the mean; ``cost_ms_per_token`` is the schema's mean gap less the free
   one's at the same ``C``, what the grammar's mask adds to a step.
2. ``invariance``: one greedy request with ``logprobs`` alone, alone again,
   and beside ``--neighbours`` others started with it (other prompts, the
   same length of answer): whether its tokens are the same, and the largest
   difference of their logprobs from the lone run's. A step of more rows is
   another GEMM shape, so its sums may round differently.

Usage (repository root)::

    PYTHONPATH=. python benchmarks/serve.py --device cuda --shape qwen0.5b --dtype bfloat16 \\
        --mode reduce-overhead --max-batch 16 --max-length 512 --tokenizer TOKDIR \\
        --build-only --work /tmp/sf
    PYTHONPATH=. python benchmarks/serve_features.py --file /tmp/sf/model.pt --out r.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness import write_result
from serve import events, start

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = [f"Request {i}: write down the person of line {3 * i + 1}." for i in range(64)]


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """One request; a streamed one gives each token's arrival time, a whole one its body."""
    t = time.perf_counter()
    if body.get("stream"):
        times: list[float] = []
        for data in events(port, body):
            times += [time.perf_counter() - t] * len(data["choices"][0].get("token_ids", []))
        return {"times": times}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {response.read()!r}")
        return json.loads(response.read())
    finally:
        conn.close()


def at_once(port: int, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every body sent at the same time, each on its own thread; their answers in order."""
    out: list[Any] = [None] * len(bodies)

    def one(i: int) -> None:
        try:
            out[i] = post(port, bodies[i])
        except Exception as e:  # a figure over fewer requests than sent would mislead
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    failed = [o for o in out if isinstance(o, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(bodies)} requests failed: {failed[0]}")
    return out


def gaps(answers: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    every = sorted(g for a in answers for g in (b - a for a, b in zip(a["times"], a["times"][1:])))
    tokens = sum(len(a["times"]) for a in answers)
    return {
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "gap_mean_ms": round(1e3 * statistics.fmean(every), 3),
        "gap_p50_ms": round(1e3 * every[len(every) // 2], 3),
        "gap_p99_ms": round(1e3 * every[min(len(every) - 1, int(0.99 * len(every)))], 3),
    }


def structured(port: int, clients: int, new: int) -> dict[str, Any]:
    result: dict[str, Any] = {"clients": clients}
    for name, extra in (
        ("plain", {"ignore_eos": True}),
        ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA, "strict": True}}}),
    ):  # fmt: skip
        bodies = [
            {"model": "model", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": new,
             "temperature": 0, "stream": True, "return_token_ids": True, **extra}
            for i in range(clients)
        ]  # fmt: skip
        at_once(port, bodies)  # untimed: the schema's compile, each row count's first step
        t = time.perf_counter()
        answers = at_once(port, bodies)
        result[name] = gaps(answers, time.perf_counter() - t)
    result["cost_ms_per_token"] = round(
        result["json_schema"]["gap_mean_ms"] - result["plain"]["gap_mean_ms"], 3
    )
    return result


def invariance(port: int, neighbours: int, new: int) -> dict[str, Any]:
    body = {"model": "model", "prompt": PROMPTS[0], "max_tokens": new, "temperature": 0}
    body |= {"logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    others = [body | {"prompt": PROMPTS[1 + i], "logprobs": None} for i in range(neighbours)]

    def read(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
        choice = answer["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    alone_ids, alone_lp = read(post(port, body))
    again_ids, again_lp = read(post(port, body))
    crowd_ids, crowd_lp = read(at_once(port, [body, *others])[0])

    def compare(ids: list[int], lp: list[float]) -> dict[str, Any]:
        same = next((i for i, (a, b) in enumerate(zip(ids, alone_ids)) if a != b), len(ids))
        diff = max((abs(a - b) for a, b in zip(lp[:same], alone_lp[:same])), default=0.0)
        return {"tokens_equal": ids == alone_ids, "first_difference": same, "max_lp_diff": diff}

    return {
        "neighbours": neighbours,
        "new_tokens": new,
        "alone_again": compare(again_ids, again_lp),
        "beside_others": compare(crowd_ids, crowd_lp),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, required=True, help="a generator file, tokenizer in")
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--neighbours", type=int, default=15)
    parser.add_argument("--work", type=Path, default=Path("/tmp/serve_features"))
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, ready = start(args.file, port, args.work / "server.log")
    result: dict[str, Any] = {"file": str(args.file), "start_to_health_s": round(ready, 3)}
    try:
        result["structured"] = []
        for c in args.clients.split(","):
            result["structured"].append(structured(port, int(c), args.new_tokens))
            print(json.dumps(result["structured"][-1]), file=sys.stderr, flush=True)
        result["invariance"] = invariance(port, args.neighbours, args.new_tokens)
        print(json.dumps(result["invariance"]), file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
