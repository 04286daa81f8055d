"""One stream's decode tokens/s through ``torch-precompile serve``: a check that the
engine's per-step work does not grow, run with two package trees on the same file.

Each tree serves FILE in a fresh process (``PYTHONPATH`` the tree); five greedy
streams of ``--tokens`` tokens (``ignore_eos``) are timed from their first chunk to
their last, on the client. Alternate the trees over several runs: on a shared CPU
one server's streams spread by a third.

    python benchmarks/serve_one_stream.py FILE TREE [TREE ...] [--tokens 80]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def rates(path: str, tree: str, tokens: int, streams: int = 5) -> list[float]:
    """Each stream's tokens/s against a server of ``tree``'s package."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    command = [sys.executable, "-m", "torch_precompile", "serve", path, "--port", str(port)]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [*command, "--model-name", "m"],
            env=dict(os.environ, PYTHONPATH=tree),
            cwd=tree,
            stdout=sink,
            stderr=sink,
        )
    try:
        while "serving" not in log.read_text():
            if proc.poll() is not None:
                raise RuntimeError(log.read_text())
            time.sleep(0.2)
        out = []
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": tokens, "stream": True}
        body.update(ignore_eos=True, temperature=0, return_token_ids=True)
        for _ in range(streams):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            times = []
            with urllib.request.urlopen(request, timeout=120) as response:
                times = [time.perf_counter() for line in response if line.startswith(b"data: {")]
            out.append((len(times) - 1) / (times[-1] - times[0]))
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--tokens", type=int, default=80)
    args = parser.parse_args()
    for tree in args.trees:
        got = rates(args.file, tree, args.tokens)
        print(f"{tree}: tokens/s {[round(r) for r in got]}, best {round(max(got))}", flush=True)


if __name__ == "__main__":
    main()
