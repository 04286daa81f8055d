"""``torch-precompile serve``: start time and throughput under 1, 4 and 16 streaming clients.

1. build (this process, transformers present): a Qwen2-shaped model of the
   given shape (random init, fixed seed), ``compile_generator`` with
   ``--max-batch`` slots, saved (``--file`` reuses a built file);
2. ``floor``: a fresh ``python -c "import torch"`` (on CUDA also the context
   and one kernel), what every server pays: from the spawn to the end of that
   work, read by the child (its exit is not counted);
3. ``start``: the server spawned (transformers not importable in it), the wall
   time from ``Popen`` to the first ``GET /health`` answered 200 (polled
   every 10 ms);
4. for each load ``C`` in ``--clients`` (1,4,16): ``C`` threads, each sending
   ``--rounds`` streaming ``/v1/completions`` in a row (token-id prompts of
   different lengths, ``8 + 11 * (i mod 8)`` tokens, ``--new-tokens`` each with
   ``ignore_eos``, greedy), raw HTTP. ``tokens_per_s`` is every new token
   over the wall time from the first request to the last answer; ``ttft`` is
   each request's time from sending to its first token's event (p50, p99);
5. ``direct``: the same file in a fresh process, ``Generator.generate`` at batch
   1 (the prompt of the first client's first request, ``--new-tokens`` tokens,
   no end token), timed after one untimed call: what one client could get with
   no server in between;
6. ``engine``: the same file and request in a fresh process, through the server's
   engine alone (no HTTP, no event loop; stepping on the main thread, a client
   thread submitting, as in the server), timed after one untimed request: of the
   gap between one client and ``direct``, what the engine's loop costs.

``--llama-server GGUF`` measures llama.cpp's ``llama-server`` instead (steps 3 and 4,
the same clients and requests): ``-np`` the file's slots (``--max-batch``), ``-c`` slots
times ``--max-length``, ``--threads`` threads; its streamed tokens are counted from each
request's ``usage`` (``stream_options.include_usage``).

Usage (repository root)::

    PYTHONPATH=. python benchmarks/serve.py --device cpu --shape tiny
    PYTHONPATH=. python benchmarks/serve.py --device cuda --shape qwen0.5b --dtype bfloat16 \
        --max-length 512 --new-tokens 128
    PYTHONPATH=. python benchmarks/serve.py --file F --max-batch 8 --max-length 128 \
        --llama-server f32.gguf --llama-bin /tmp/llamacpp/build/bin --new-tokens 32
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import child_env, run_child, write_result

SHAPES = {
    "tiny": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ),
    # Qwen2.5-0.5B's shape (random weights).
    "qwen0.5b": dict(
        num_hidden_layers=24,
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}

_SERVER = """
import sys
sys.modules["transformers"] = None
from torch_precompile_cli import main  # as the torch-precompile script starts
sys.exit(main(sys.argv[1:]))
"""


def build(args: argparse.Namespace, path: Path) -> None:
    import torch
    import transformers

    from torch_precompile import Precompile
    from torch_precompile.generation import compile_generator

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **SHAPES[args.shape], max_position_embeddings=max(args.max_length, 128)
    )
    tokenizer = None
    if args.tokenizer:  # its end token ends a grammar's answers; the loads ignore it
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    config.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
    model = transformers.Qwen2ForCausalLM(config).to(args.device, getattr(torch, args.dtype))
    generator = compile_generator(
        model.eval(),
        max_batch=args.max_batch,
        max_length=args.max_length,
        mode=args.mode,
        tokenizer=tokenizer,
    )
    Precompile.save(path, generator)


def floor(device: str) -> float:
    """Spawn to the end of ``import torch`` (and the CUDA context, one kernel), read by
    the child: its exit, which a server never waits for, is not counted."""
    code = "import time, torch"
    if device == "cuda":
        code += "; torch.ones(1, device='cuda').add_(1); torch.cuda.synchronize()"
    code += "; print(time.time())"
    t = time.time()
    return float(run_child(code).split()[-1]) - t


def start(path: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    command = [sys.executable, "-c", _SERVER, "serve", str(path), "--port", str(port)]
    return started([*command, "--model-name", "model"], port, log, child_env())


def start_llama(args: argparse.Namespace, port: int, log: Path) -> tuple[Any, float]:
    """llama.cpp's server on ``--llama-server``'s file, slots and context as ours."""
    command = [f"{args.llama_bin}/llama-server", "-m", args.llama_server, "--port", str(port)]
    command += ["-np", str(args.max_batch), "-c", str(args.max_batch * args.max_length)]
    command += ["-t", str(args.threads), "--alias", "model"]
    return started(command, port, log, None)


def started(
    command: list[str], port: int, log: Path, env: dict[str, str] | None
) -> tuple[subprocess.Popen[bytes], float]:
    """The server spawned, and the seconds from the spawn to ``/health`` answering 200."""
    t = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.Popen(command, env=env, stderr=err, stdout=err)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, time.perf_counter() - t
        except OSError:
            pass
        time.sleep(0.01)


_DIRECT = """
import json, sys, time, torch
sys.modules["transformers"] = None  # as in the server: torch and the file only
from torch_precompile import Precompile
path, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gen = Precompile.load(path)
ids = torch.tensor([[(3 * k) % 900 + 50 for k in range(n)]], device=gen.spec.device)
for _ in range(2):
    if gen.spec.device != "cpu":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = gen.generate(ids, max_new_tokens=new, eos_token_id=None, do_sample=False)
    out.tolist()
    wall = time.perf_counter() - t
print(json.dumps({"tokens": out.shape[1] - n, "tokens_per_s": round((out.shape[1] - n) / wall, 1)}))
"""


def direct(path: Path, new: int) -> dict[str, Any]:
    """``Generator.generate`` at batch 1 on the same file, in a fresh process."""
    return json.loads(run_child(_DIRECT, str(path), "8", str(new)).splitlines()[-1])


_ENGINE = """
import dataclasses, json, sys, threading, time
sys.modules["transformers"] = None  # as in the server: torch and the file only
from torch_precompile import Precompile
from torch_precompile.serve.engine import Engine
from torch_precompile.serve.protocol import Job
path, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = Engine(Precompile.load(path), max_queue=1)
engine.warm()
job = dataclasses.replace(
    Job(False, "m", [(3 * k) % 900 + 50 for k in range(n)], new, temperature=0), ignore_eos=True
)
result = {}
def client():  # as an HTTP thread of the server: it submits; the main thread steps
    try:
        for _ in range(2):
            done, tokens = threading.Event(), []
            def sink(event):  # a Delta, or a Failed (no finish)
                tokens.extend(getattr(event, "token_ids", ()))
                if getattr(event, "finish", True) is not None:
                    done.set()
            t = time.perf_counter()
            engine.open(job, sink)
            done.wait(600)
            wall = time.perf_counter() - t
        result.update(tokens=len(tokens), tokens_per_s=round(len(tokens) / wall, 1))
    finally:
        engine.stop()
threading.Thread(target=client).start()
engine.run()
print(json.dumps(result))
"""


def engine(path: Path, new: int) -> dict[str, Any]:
    """The server's engine alone, one request as ``direct``'s, in a fresh process."""
    return json.loads(run_child(_ENGINE, str(path), "8", str(new)).splitlines()[-1])


def events(port: int, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A streamed ``/v1/completions``: each server-sent event's data as it arrives
    (``[DONE]`` left out); a status other than 200 raises with the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {response.read()!r}")
        buffer = b""
        while chunk := response.read1(65536):
            buffer += chunk
            *done, buffer = buffer.split(b"\n\n")
            for event in done:
                if event != b"data: [DONE]":
                    yield json.loads(event[len(b"data: ") :])
    finally:
        conn.close()


def stream(port: int, prompt: list[int], new: int) -> tuple[float, int]:
    """One streaming completion: (seconds to the first token, tokens received)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": new, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True, "return_token_ids": True}
    body |= {"stream_options": {"include_usage": True}}
    t = time.perf_counter()
    first, tokens, usage = None, 0, None
    for data in events(port, body):
        usage = data.get("usage") or usage
        choices = data.get("choices") or [{}]
        # llama-server's chunks carry no token ids, and a token's text may be empty (a
        # character's first bytes): a chunk with a choice is a token either way
        got = len(choices[0].get("token_ids", [])) or bool(data.get("choices"))
        if got and first is None:
            first = time.perf_counter() - t
        tokens += len(choices[0].get("token_ids", []))
    if usage is not None:  # llama-server sends no token ids: its count
        tokens = usage["completion_tokens"]
    return first or float("nan"), tokens


def load(port: int, clients: int, rounds: int, new: int) -> dict[str, Any]:
    ttfts: list[float] = []
    total = [0]
    failed: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            for r in range(rounds):
                n = 8 + 11 * ((i + r) % 8)
                prompt = [(7 * i + 3 * k + r) % 900 + 50 for k in range(n)]
                ttft, tokens = stream(port, prompt, new)
                with lock:
                    ttfts.append(ttft)
                    total[0] += tokens
        except Exception as e:  # a figure over fewer requests than sent would mislead
            with lock:
                failed.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if failed:
        raise RuntimeError(f"{len(failed)} of {clients} clients failed; the first: {failed[0]}")
    ttfts.sort()
    return {
        "clients": clients,
        "requests": len(ttfts),
        "tokens": total[0],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total[0] / wall, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
    }


def file_parser(doc: str, *, max_batch: int, max_length: int, work: str) -> argparse.ArgumentParser:
    """The options of a benchmark that serves one built file (``--file``, or built here
    from ``--shape`` and the rest); a script adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch", type=int, default=max_batch)
    parser.add_argument("--max-length", type=int, default=max_length)
    parser.add_argument("--file", type=Path, default=None, help="a built file to serve")
    parser.add_argument("--work", type=Path, default=Path(work))
    parser.add_argument(
        "--mode", default=None, help="compile_generator's mode (CUDA graphs: reduce-overhead)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer directory the file holds (text in and out)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    return parser


def built_file(args: argparse.Namespace) -> Path:
    """``--file``, or the file built from the options into ``--work``."""
    args.work.mkdir(parents=True, exist_ok=True)
    if args.file is not None:
        return args.file
    path = args.work / "model.pt"
    t = time.perf_counter()
    build(args, path)
    print(f"built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return path


def main() -> None:
    parser = file_parser(__doc__, max_batch=16, max_length=256, work="/tmp/serve_bench")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="requests per client in a row")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--build-only", action="store_true", help="build the file and stop")
    parser.add_argument("--llama-server", default=None, help="a GGUF file: llama-server's run")
    parser.add_argument("--llama-bin", default="/tmp/llamacpp/build/bin")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    args = parser.parse_args()
    path = None if args.llama_server else built_file(args)
    if args.build_only:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result: dict[str, Any] = {"device": args.device, "shape": args.shape, "dtype": args.dtype}
    result |= {"max_batch": args.max_batch, "max_length": args.max_length}
    result |= {"new_tokens": args.new_tokens, "rounds": args.rounds}
    result["floor_s"] = round(floor(args.device), 3)
    args.work.mkdir(parents=True, exist_ok=True)
    if path is None:
        result["server"] = f"llama-server {args.llama_server}"
        proc, ready = start_llama(args, port, args.work / "llama-server.log")
    else:
        result["server"] = f"torch-precompile serve {path}"
        proc, ready = start(path, port, args.work / "server.log")
    result["start_to_health_s"] = round(ready, 3)
    print(json.dumps(result), file=sys.stderr, flush=True)
    try:
        load(port, 1, 1, 4)  # untimed: the first requests' allocations
        result["loads"] = []
        for c in args.clients.split(","):  # each printed as it ends: a cut run keeps them
            result["loads"].append(load(port, int(c), args.rounds, args.new_tokens))
            print(json.dumps(result["loads"][-1]), file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    if path is not None:
        result["direct"] = direct(path, args.new_tokens)
        result["engine"] = engine(path, args.new_tokens)
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
