"""The ``torch-precompile`` command line: ``inspect`` and ``bench`` an artifact file.

``inspect`` reads the header only (``_format.read_info``): it validates the
file's checksum and never unpickles, so it is safe on untrusted files and does
not import the compiler. ``bench`` loads the artifact (which runs code from
the file, as ``Precompile.load`` does) and times it on random inputs built
from the recorded input signature.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import _format
from ._errors import PrecompileError

PROG = "torch-precompile"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Look at and time torch_precompile artifacts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser(
        "inspect", help="print an artifact's header (never unpickles: safe on untrusted files)"
    )
    p_inspect.add_argument("path")
    p_inspect.add_argument("--json", action="store_true", help="print the header as JSON")
    p_bench = sub.add_parser(
        "bench", help="load an artifact and time load, first call and steady calls"
    )
    p_bench.add_argument("path")
    p_bench.add_argument("--iters", type=int, default=50, help="timed steady calls (default 50)")
    p_bench.add_argument(
        "--warmup", type=int, default=3, help="untimed calls after the first (default 3)"
    )
    p_bench.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p_bench.add_argument("--json", action="store_true", help="print the timings as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.path, as_json=args.json)
        return _bench(
            args.path, iters=args.iters, warmup=args.warmup, seed=args.seed, as_json=args.json
        )
    except BrokenPipeError:  # `... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except (PrecompileError, OSError, ValueError, TypeError) as exc:
        print(f"{PROG}: error: {_one_line(exc, args.path)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException, path: str) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{path}: {exc.strerror}"
    return text


# ------------------------------------------------------------------ inspect


def header(path: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as one JSON-able dict (header only, no unpickling)."""
    try:
        info = _format.read_info(path)
    except PrecompileError as exc:
        with open(path, "rb") as f:
            prefix = f.read(2)
        if prefix[:1] == b"\x80" and not _format.looks_like_artifact(prefix):
            raise type(exc)(
                f"{path} is not a torch_precompile artifact: it looks like a pickle (a file of "
                "torch's save_compiled_function?); inspect never unpickles, load it with "
                "Precompile.load(path, model=...)"
            ) from None
        raise
    return {
        "path": os.path.abspath(path),
        "format_version": info.format_version,
        "signed": info.signed,
        "file_size": info.file_size,
        "sections": [
            {"name": s["name"], "length": s["length"], "sha256": s["sha256"]} for s in info.sections
        ],
        "meta": info.meta,
    }


def _inspect(path: str, *, as_json: bool) -> int:
    data = header(path)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=False))
    else:
        print(format_header(data))
    return 0


def format_header(data: dict[str, Any]) -> str:
    """The human-readable view of :func:`header`'s dict."""
    from ._artifact import _signature_lines, human_size
    from ._guards import Guards

    meta = data["meta"]
    system = meta.get("system", {})
    signed = "signed (HMAC-SHA256)" if data["signed"] else "unsigned"
    kind = "training" if meta.get("training") else "inference"
    lines = [
        f"{data['path']}: torch_precompile artifact, format version {data['format_version']}, "
        f"{human_size(data['file_size'])}, {signed}",
        f"producer:  {meta.get('producer', '?')}",
        f"created:   {meta.get('created', '?')}",
        f"kind:      {kind}, device {meta.get('device_type', '?')}, "
        f"captured from a {meta.get('kind', '?')}",
        "system:    "
        + ", ".join(
            part
            for part in (
                f"torch {system.get('torch')}" if system.get("torch") else "",
                f"Python {system.get('python')}" if system.get("python") else "",
                " ".join(str(system[k]) for k in ("platform", "os") if system.get(k)),
                f"CPU instruction set {system['cpu_isa']}" if system.get("cpu_isa") else "",
                _cuda(system.get("cuda")),
            )
            if part
        ),
        "signature:",
    ]
    lines.extend(f"  {line}" for line in _signature_lines(meta.get("signature", {})))
    sizes = meta.get("sizes") or {s["name"]: s["length"] for s in data["sections"]}
    lines.append("sizes:     " + ", ".join(f"{k} {human_size(v)}" for k, v in sizes.items()))
    timings = meta.get("timings") or {}
    if timings:
        lines.append("timings:   " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
    guards = Guards.from_json(meta.get("guards", []))
    lines.append(f"guards ({len(guards)}), by stage:")
    lines.extend(f"  {line}" for line in str(guards).splitlines())
    return "\n".join(lines)


def _cuda(cuda: Any) -> str:
    if not cuda:
        return ""
    if isinstance(cuda, dict):
        return f"CUDA {cuda.get('name', '')} capability {cuda.get('capability', '?')}".replace(
            "  ", " "
        )
    return f"CUDA {cuda}"


# -------------------------------------------------------------------- bench


def _bench(path: str, *, iters: int, warmup: int, seed: int, as_json: bool) -> int:
    import torch

    from ._io import load
    from ._signature import example_call

    _format.read_info(path)  # a non-artifact fails here, before anything is unpickled
    start = time.perf_counter()
    artifact = load(path)
    load_s = time.perf_counter() - start
    runtime = artifact._runtime
    args, kwargs = example_call(
        runtime.signature,
        artifact.signature.get("parameters", {}),
        skip_first=runtime.bound_self is not None,
        seed=seed,
    )
    grad = torch.enable_grad if artifact.training else torch.no_grad
    with grad():
        start = time.perf_counter()
        artifact(*args, **kwargs)
        first_s = time.perf_counter() - start
        for _ in range(warmup):
            artifact(*args, **kwargs)
        steady = []
        for _ in range(max(1, iters)):
            start = time.perf_counter()
            artifact(*args, **kwargs)
            steady.append(time.perf_counter() - start)
    result = {
        "path": os.path.abspath(path),
        "load_s": load_s,
        "first_call_s": first_s,
        "steady_median_s": statistics.median(steady),
        "steady_mean_s": statistics.fmean(steady),
        "steady_min_s": min(steady),
        "iters": len(steady),
        "threads": torch.get_num_threads(),
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['path']}\n"
            f"load:         {load_s * 1e3:9.1f} ms  "
            "(Precompile.load: checksum, system check, kernels, weights)\n"
            f"first call:   {first_s * 1e3:9.3f} ms\n"
            f"steady call:  {result['steady_median_s'] * 1e3:9.3f} ms median, "
            f"{result['steady_min_s'] * 1e3:.3f} ms min, over {len(steady)} calls "
            f"({result['threads']} threads; random inputs from the recorded signature)"
        )
    return 0
