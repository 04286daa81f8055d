"""Compile time: ``Precompile.compile`` vs torch's ``aot_compile`` on the same model.

Each measurement runs in a fresh process with its own empty Inductor cache
(so neither side profits from the other's cached kernels), alternating the two
tools, and the medians are compared. Usage::

    python benchmarks/compile_time.py [--model transformer] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = """
import sys, time, torch
sys.path.insert(0, {root!r})
from tests.fixtures.models import BUILDERS
model, args, kwargs = BUILDERS[{model!r}]()
tool = {tool!r}
with torch.no_grad():
    t0 = time.perf_counter()
    if tool == "torch_aot_compile":
        fn = torch.compile(model, fullgraph=True).forward.aot_compile((args, kwargs))
        out = fn(model, *args, **kwargs)
    else:
        from torch_precompile import Precompile
        art = Precompile.compile(model, args, kwargs)
        out = art(*args, **kwargs)
    elapsed = time.perf_counter() - t0
    torch.testing.assert_close(out, model(*args, **kwargs))
print(elapsed)
"""


def measure(tool: str, model: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache)
        src = CASE.format(root=str(ROOT), model=model, tool=tool)
        proc = subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} failed:\n{proc.stderr[-3000:]}")
        return float(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    tools = ("torch_aot_compile", "torch_precompile")
    times: dict[str, list[float]] = {t: [] for t in tools}
    for _ in range(opts.runs):
        for tool in tools:  # alternate, so machine noise hits both alike
            times[tool].append(measure(tool, opts.model))
    med = {t: statistics.median(v) for t, v in times.items()}
    ratio = med["torch_precompile"] / med["torch_aot_compile"]
    print(
        f"compile time, {opts.model}, empty Inductor cache, median of {opts.runs} fresh processes"
    )
    print("| tool | median (s) | runs (s) |\n|---|---|---|")
    for t in tools:
        print(f"| {t} | {med[t]:.2f} | {', '.join(f'{x:.2f}' for x in times[t])} |")
    print(f"Precompile.compile / aot_compile = {ratio:.3f}")
    if opts.json:
        opts.json.write_text(
            json.dumps({"model": opts.model, "times": times, "median": med, "ratio": ratio})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
