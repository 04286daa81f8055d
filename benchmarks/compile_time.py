"""Compile time: ``Precompile.compile`` vs torch's ``aot_compile`` on the same model.

Each measurement runs in a fresh process with its own empty Inductor cache
(so neither side profits from the other's cached kernels), alternating the two
tools, and the medians are compared. Usage::

    python benchmarks/compile_time.py [--model transformer] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import empty_caches, run_child, spread, write_result

CASE = """
import sys, time, torch
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
    with empty_caches() as env:
        out = run_child(CASE.format(model=model, tool=tool), env=env)
    return float(out.strip().splitlines()[-1])


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
    figures = {t: spread(v) for t, v in times.items()}
    med = {t: f["median"] for t, f in figures.items()}
    ratio = med["torch_precompile"] / med["torch_aot_compile"]
    print(
        f"compile time, {opts.model}, empty Inductor cache, median of {opts.runs} fresh processes"
    )
    print("| tool | median (s) | runs (s) |\n|---|---|---|")
    for t in tools:
        print(f"| {t} | {med[t]:.2f} | {', '.join(f'{x:.2f}' for x in times[t])} |")
    print(f"Precompile.compile / aot_compile = {ratio:.3f}")
    if opts.json:
        write_result(opts.json, {"model": opts.model, "seconds": figures, "ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
