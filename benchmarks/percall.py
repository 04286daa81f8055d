"""Per-call time, side by side in one process: eager, ``torch.compile`` and ours.

A 2-core machine drifts by 10-20% between processes, more than the gaps this
measures, so the three run *interleaved* in one fresh process: each round
times a batch of calls of every method (in rotating order), and each method's
figure is the median of its rounds. All calls run under ``torch.no_grad()``.

- ``eager``: the model built and its weights loaded.
- ``torch.compile``: ``torch.compile(model)`` (default Inductor), compiled in
  the measuring process and warmed up.
- ``ours``: ``Precompile.load(path)`` of an artifact built and saved by another
  process (the stand-in weights; no ``model=``).

Usage (from the repository root)::

    python benchmarks/percall.py                       # transformer and tiny_mlp
    python benchmarks/percall.py --models tiny_mlp --rounds 40
    python benchmarks/percall.py --device cuda --models transformer gpt   # a GPU

On CUDA two more methods run in the same rotation: ``torch.compile(model,
mode="reduce-overhead")`` and ours compiled with that mode (CUDA graphs
recorded after a lean load).

It prints a markdown table and writes ``benchmarks/results/percall_cpu.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from harness import REPO, child_env, last_json, run_child, write_result

METHODS = ("eager", "torch.compile", "ours")

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from tests.fixtures.models import BUILDERS
    from torch_precompile import Precompile

    mode, name, work, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    device = sys.argv[5]
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, args, kwargs = BUILDERS[name]()
    model = model.to(device)
    args = tuple(a.to(device) for a in args)
    if mode == "build":
        with torch.no_grad():
            art = Precompile.compile(model, args, kwargs)
            Precompile.save(f"{work}/{name}.pt", art)
            if cuda:
                art = Precompile.compile(model, args, kwargs, mode="reduce-overhead")
                Precompile.save(f"{work}/{name}.ro.pt", art)
        torch.save(model.state_dict(), f"{work}/{name}.weights.pt")
        sys.exit(0)

    model.load_state_dict(torch.load(f"{work}/{name}.weights.pt", weights_only=True))
    fns = {
        "eager": model,
        "torch.compile": torch.compile(model),
        "ours": Precompile.load(f"{work}/{name}.pt"),
    }
    if cuda:  # mode="reduce-overhead": CUDA graphs (ours: recorded after a lean load)
        fns["torch.compile reduce-overhead"] = torch.compile(model, mode="reduce-overhead")
        fns["ours reduce-overhead"] = Precompile.load(f"{work}/{name}.ro.pt")
    lean = {k: type(getattr(f, "compiled_function", None)).__name__ == "LeanCompiledFunction"
             for k, f in fns.items()}
    with torch.no_grad():
        ref = model(*args, **kwargs)
        diffs = {}
        for key, fn in fns.items():
            for _ in range(10):
                out = fn(*args, **kwargs)
            diffs[key] = (out.float() - ref.float()).abs().max().item()
        sync()
        t = time.perf_counter()
        for _ in range(10):
            model(*args, **kwargs)
        sync()
        per_batch = max(1, int(0.05 / ((time.perf_counter() - t) / 10)))
        keys = list(fns)
        times = {key: [] for key in keys}
        for r in range(rounds):
            for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                fn = fns[key]
                sync()
                t = time.perf_counter()
                for _ in range(per_batch):
                    fn(*args, **kwargs)
                sync()
                times[key].append((time.perf_counter() - t) / per_batch)
    print(json.dumps({"times": times, "max_diff": diffs, "per_batch": per_batch,
                      "threads": torch.get_num_threads(), "lean": lean,
                      "device": torch.cuda.get_device_name(0) if cuda else "cpu"}))
    """
)


def run_model(name: str, rounds: int, work: Path, device: str = "cpu") -> dict[str, Any]:
    script = work / "child.py"
    script.write_text(CHILD)
    for mode in ("build", "measure"):
        out = run_child(
            [sys.executable, str(script)],
            mode,
            name,
            str(work),
            str(rounds),
            device,
            env=child_env(),
        )
    raw = last_json(out)
    result: dict[str, Any] = {
        "per_batch": raw["per_batch"],
        "threads": raw["threads"],
        "device": raw["device"],
        "lean": raw["lean"],
    }
    for key in raw["times"]:
        ts = sorted(raw["times"][key])
        q = statistics.quantiles(ts, n=4)
        result[key] = {
            "median_s": statistics.median(ts),
            "q1_s": q[0],
            "q3_s": q[2],
            "max_diff_vs_eager": raw["max_diff"][key],
        }
    return result


def _fmt(v: float) -> str:
    return f"{v * 1e3:.2f} ms" if v >= 1e-3 else f"{v * 1e6:.1f} µs"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | eager | torch.compile | ours | ours / eager | ours / torch.compile |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        e, j, o = (r[k]["median_s"] for k in METHODS)
        cells = [_fmt(e), _fmt(j), _fmt(o), f"{o / e:.2f}x", f"{o / j:.2f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        ro = ("torch.compile reduce-overhead", "ours reduce-overhead")
        if all(k in r for k in ro):
            j, o = (r[k]["median_s"] for k in ro)
            cells = ["", _fmt(j), _fmt(o), f"{o / e:.2f}x", f"{o / j:.2f}x"]
            lines.append(f"| {name}, reduce-overhead | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["transformer", "tiny_mlp"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/percall_<device>.json"
    )
    ns = parser.parse_args(argv)
    ns.out = ns.out or str(REPO / f"benchmarks/results/percall_{ns.device}.json")
    results = {}
    with tempfile.TemporaryDirectory(prefix="percall-") as tmp:
        for name in ns.models:
            print(f"[percall] {name}", file=sys.stderr, flush=True)
            results[name] = run_model(name, ns.rounds, Path(tmp), ns.device)
    write_result(ns.out, {"rounds": ns.rounds, "results": results})
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
