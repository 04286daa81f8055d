"""What a cold start of ``torch-precompile serve`` costs, beside the floor ``import torch``.

Each run starts a fresh process and times it from its start to the first 200 on
``/health`` (the readiness probe's answer). Then the server is stopped; its stop
is not counted. Runs of each command alternate with runs of the floor
(``python -c "import torch"``, start to exit), so a drift of the machine's speed
moves both. Prints the median, min and max of each, and writes them as JSON::

    python benchmarks/serve_start.py --runs 5 --out benchmarks/results/x.json \\
        FILE_OR_MODEL_DIR [more ...] [-- serve options]

The build's options (``--max-batch`` ...) after ``--`` go to the model directories only.

A ``MODEL_DIR`` whose file is not in the cache builds it at the first run; pass
``--warm`` to leave that run out (it is reported on its own as ``build_s``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def start_to_ready(target: str, options: list[str], env: dict[str, str], limit: float) -> float:
    """Seconds from ``serve target``'s start to its first healthy answer."""
    port = _free_port()
    command = [sys.executable, "-m", "torch_precompile", "serve", target, "--port", str(port)]
    if not os.path.isdir(target):  # a built file: the build's options are refused
        options = _without(options, BUILD_OPTIONS)
    began = time.perf_counter()
    proc = subprocess.Popen(
        [*command, *options], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while time.perf_counter() - began < limit:
            if proc.poll() is not None:
                raise RuntimeError(f"serve {target} exited with {proc.returncode}")
            if _healthy(port):
                return time.perf_counter() - began
            time.sleep(0.05)
        raise RuntimeError(f"serve {target} was not ready within {limit} s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


BUILD_OPTIONS = ("--max-batch", "--max-length", "--dtype", "--device", "--mode")


def _without(options: list[str], flags: tuple[str, ...]) -> list[str]:
    """``options`` less each of ``flags`` and its value."""
    out, skip = [], False
    for item in options:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        elif not item.startswith(tuple(f + "=" for f in flags)):
            out.append(item)
    return out


def floor(env: dict[str, str]) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
    return time.perf_counter() - began


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(values),
        "min_s": min(values),
        "max_s": max(values),
        "runs": len(values),
    }


def main() -> int:
    argv = sys.argv[1:]
    options = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="generator files or model directories")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warm", action="store_true", help="one untimed first run per target")
    parser.add_argument("--limit", type=float, default=1800, help="seconds a start may take")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result: dict[str, object] = {
        "options": options,
        "threads_env": os.environ.get("OMP_NUM_THREADS"),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    floors: list[float] = []
    for target in args.targets:
        if args.warm:
            result[f"{target} build_s"] = start_to_ready(target, options, env, args.limit)
        times = []
        for _ in range(args.runs):
            times.append(start_to_ready(target, options, env, args.limit))
            floors.append(floor(env))
        result[target] = _summary(times)
        print(f"{target}: ready in {result[target]}", flush=True)
    result["floor: python -c 'import torch'"] = _summary(floors)
    print(f"floor, import torch: {_summary(floors)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
