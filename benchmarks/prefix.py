"""``torch-precompile serve``: prefix reuse and chunked prefill, each against the server
without it, in fresh servers alternating A/B.

1. build (this process, transformers present): serve.py's Qwen2-shaped model of
   ``--shape`` (random init, fixed seed), ``--max-batch`` slots, ``--max-length``
   (``--file`` reuses a built file);
2. ``reuse``: per round, a fresh server with reuse and one with
   ``--no-prefix-reuse``, alternately. In each: turn 1, a streamed completion of a
   ``--prompt-tokens`` token-id prompt (``--new-tokens`` greedy tokens); turn 2,
   turn 1's prompt, its answer and 16 new tokens, streamed: its time to first
   token (send to the first token's event) and its
   ``usage.prompt_tokens_details.cached_tokens``;
3. ``chunk``: per round, a fresh server with ``--prefill-chunk`` and one with
   ``--prefill-chunk 0`` (a prompt at once), alternately. In each: ``--streams``
   streams decode (short prompts, ``--stream-tokens`` tokens each, ``ignore_eos``);
   once every one has 8 tokens, a ``--prompt-tokens`` prompt joins. Per server,
   the streams' gaps between tokens from its send to its first token (``join``)
   and in the 8 tokens before (``calm``): p50, p99, max.

Usage (repository root)::

    PYTHONPATH=. python benchmarks/prefix.py --device cpu --shape tiny
    PYTHONPATH=. python benchmarks/prefix.py --device cuda --shape qwen0.5b --dtype bfloat16 \
        --max-length 4096 --prompt-tokens 3000 --prefill-chunk 512
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness import child_env, write_result
from serve import _SERVER, built_file, events, file_parser


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A fresh ``serve`` process with these flags, until :meth:`stop`."""

    def __init__(self, path: Path, log: Path, *flags: str) -> None:
        self.port = _port()
        command = [sys.executable, "-c", _SERVER, "serve", str(path), "--port", str(self.port)]
        command += ["--model-name", "model", *flags]
        with log.open("w") as err:
            self.proc = subprocess.Popen(command, env=child_env(), stderr=err, stdout=err)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log.read_text()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def stream(port: int, prompt: list[int], new: int, on_token: Any = None) -> dict[str, Any]:
    """One streamed greedy completion: its token ids, the time of each token's event
    (from the send), and its usage."""
    body = {"model": "model", "prompt": prompt, "max_tokens": new, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True, "return_token_ids": True}
    body |= {"stream_options": {"include_usage": True}}
    ids: list[int] = []
    times: list[float] = []
    usage: dict[str, Any] = {}
    t = time.perf_counter()
    for data in events(port, body):
        usage = data.get("usage") or usage
        for choice in data["choices"]:
            for token in choice.get("token_ids", []):
                ids.append(token)
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(ids))
    return {"ids": ids, "sent": t, "times": times, "usage": usage}


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * k + 13 * salt) % 900 + 50 for k in range(n)]


def reuse_round(path: Path, work: Path, args: argparse.Namespace, reuse: bool) -> dict[str, Any]:
    flags = () if reuse else ("--no-prefix-reuse",)
    server = Served(path, work / "reuse.log", *flags)
    try:
        stream(server.port, _prompt(8, 99), 4)  # untimed: the first request's allocations
        first = _prompt(args.prompt_tokens, 1)
        turn1 = stream(server.port, first, args.new_tokens)
        second = first + turn1["ids"] + _prompt(16, 2)
        turn2 = stream(server.port, second, args.new_tokens)
    finally:
        server.stop()
    details = turn2["usage"].get("prompt_tokens_details") or {}
    return {
        "reuse": reuse,
        "prompt_tokens": turn2["usage"]["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens"),
        "turn1_ttft_s": round(turn1["times"][0] - turn1["sent"], 4),
        "turn2_ttft_s": round(turn2["times"][0] - turn2["sent"], 4),
        "turn2_ids": turn2["ids"],
    }


def _gaps(runs: list[dict[str, Any]], since: float, until: float) -> list[float]:
    out = []
    for run in runs:
        times = run["times"]
        out += [b - a for a, b in itertools.pairwise(times) if b > since and a < until]
    return sorted(out)


def _spread(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {}
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return {
        "gaps": len(gaps),
        "p50_s": round(statistics.median(gaps), 4),
        "p99_s": round(p99, 4),
        "max_s": round(gaps[-1], 4),
    }


def chunk_round(path: Path, work: Path, args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    server = Served(path, work / "chunk.log", "--prefill-chunk", str(chunk))
    runs: list[dict[str, Any]] = [{} for _ in range(args.streams)]
    started = [threading.Event() for _ in range(args.streams)]
    try:
        stream(server.port, _prompt(8, 99), 4)

        def client(i: int) -> None:
            def seen(n: int) -> None:
                if n == 8:
                    started[i].set()

            runs[i] = stream(server.port, _prompt(4, 10 + i), args.stream_tokens, seen)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.streams)]
        for thread in threads:
            thread.start()
        for event in started:
            event.wait(600)
        joined = stream(server.port, _prompt(args.prompt_tokens, 3), 4)
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    sent, first = joined["sent"], joined["times"][0]
    before = [t for run in runs for t in run["times"][:8]]
    return {
        "prefill_chunk": chunk,
        "join_s": round(first - sent, 4),
        "join": _spread(_gaps(runs, sent, first)),
        "calm": _spread(_gaps(runs, min(before), sent)),
        "streams_after_join": sum(1 for run in runs if run["times"][-1] > first),
        "joined_ids": joined["ids"],
    }


def main() -> None:
    parser = file_parser(__doc__, max_batch=8, max_length=1024, work="/tmp/prefix_bench")
    parser.add_argument("--prompt-tokens", type=int, default=768)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--prefill-chunk", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs of fresh servers")
    args = parser.parse_args()
    path = built_file(args)
    result: dict[str, Any] = {"device": args.device, "shape": args.shape, "dtype": args.dtype}
    for key in ("max_batch", "max_length", "prompt_tokens", "new_tokens", "streams"):
        result[key] = getattr(args, key)
    result |= {"stream_tokens": args.stream_tokens, "reuse": [], "chunk": []}
    for _ in range(args.rounds):
        for reuse in (True, False):
            result["reuse"].append(reuse_round(path, args.work, args, reuse))
            print(json.dumps(result["reuse"][-1]), file=sys.stderr, flush=True)
        for chunk in (args.prefill_chunk, 0):
            result["chunk"].append(chunk_round(path, args.work, args, chunk))
            print(json.dumps(result["chunk"][-1]), file=sys.stderr, flush=True)
    answers = {json.dumps(r["turn2_ids"]) for r in result["reuse"]}
    joined = {json.dumps(r["joined_ids"]) for r in result["chunk"]}
    result["same_answers"] = len(answers) == 1 and len(joined) == 1
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
