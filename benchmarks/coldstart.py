"""Cold-start benchmark: wall time from process start to first output, side by side.

Cases, each run in a fresh Python process:

- ``eager``: build the model, load its weights (``state_dict`` file), call it.
- ``jit``: the same, then ``torch.compile(model)`` and call it (compiles in the run).
- ``aot_compile``: load what torch's ``aot_compile`` + ``save_compiled_function``
  wrote (``torch.compiler.load_compiled_function``); the model is built and its
  weights loaded, since that file holds no weights.
- ``aoti``: ``torch._inductor.aoti_load_package`` of an AOTInductor package.
- ``mega_cache``: ``torch.compiler.load_cache_artifacts`` of the bytes
  ``torch.compiler.save_cache_artifacts`` wrote after a compile, then
  ``torch.compile`` and call.
- ``precompile``: PyTorch 2.14's ``torch.compiler.precompile`` (a ``make_fx``
  trace lowered by AOTAutograd and Inductor to Python source plus a kernel
  cache): ``torch.compiler.precompile.load(code, cache)`` and call with the
  model, built and its weights loaded (the source holds no weights). Skipped,
  with a note, on a torch that lacks it.
- ``ours``: ``Precompile.load(path)`` and call (weights travel in the file).

Each case runs *cold* (fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, Triton cache,
``TMPDIR`` and ``XDG_CACHE_HOME``) and *warm* (the caches the build and one untimed
warm-up run left). Reported: median wall time to first output over ``--runs``
runs, steady per-call time (``torch.no_grad()``, median of batches), compile
time, file size, and the largest difference from eager's output.

Usage (from the repository root)::

    python benchmarks/coldstart.py                 # both models, all cases, 3 runs
    python benchmarks/coldstart.py --models tiny_mlp --cases eager ours --runs 1
    python benchmarks/coldstart.py --cases eager ours aot_compile precompile --runs 2 \
        --out benchmarks/results/coldstart_cpu_torch2.14.json --log

It prints markdown tables and writes ``benchmarks/results/coldstart_cpu.json``
(rewritten after each case); ``--log`` (or ``--readme``) also adds the tables to
docs/measurements.md as a new entry at the top, and
``--from-json FILE`` renders an earlier run without running anything.
Only one process runs at a time; timings on a machine shared with other work
are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from harness import REPO, child_env, machine, run_child

MODELS = ("transformer", "tiny_mlp")
CASES = ("eager", "ours", "jit", "aot_compile", "precompile", "aoti", "mega_cache")
LABELS = {
    "eager": "eager (build + load weights)",
    "jit": "torch.compile (JIT)",
    "aot_compile": "torch aot_compile + load_compiled_function",
    "precompile": "torch.compiler.precompile + load (torch 2.14+)",
    "aoti": "AOTInductor aoti_load_package",
    "mega_cache": "torch.compile + mega-cache",
    "ours": "torch_precompile load",
}
FILE_NOTES = {
    "eager": "state_dict",
    "aot_compile": "no weights",
    "precompile": "source + kernel cache, no weights",
    "aoti": "weights included",
    "mega_cache": "cache only, no weights",
    "ours": "weights + kernels included",
}

# Runs in the child: prepares inputs, builds artifacts, or runs one case.
CHILD = r'''
import json, os, sys, time
import torch
from tests.fixtures.models import BUILDERS

mode, case, model_name, work = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
paths = {
    "io": os.path.join(work, "io.pt"),
    "weights": os.path.join(work, "weights.pt"),
    "aot_compile": os.path.join(work, "model.aot"),
    "precompile": os.path.join(work, "model_precompiled.py"),
    "aoti": os.path.join(work, "model.pt2"),
    "mega_cache": os.path.join(work, "mega.bin"),
    "ours": os.path.join(work, "model.tpc"),
}

def built():
    model, _, _ = BUILDERS[model_name]()
    model.load_state_dict(torch.load(paths["weights"], weights_only=True))
    return model

def steady(fn, args):
    """Median over batches of the mean per-call time (seconds), under no_grad."""
    with torch.no_grad():
        for _ in range(5):
            fn(*args)
        t = time.perf_counter(); fn(*args); one = time.perf_counter() - t
        per_batch = max(1, min(2000, int(0.05 / max(one, 1e-7))))
        means = []
        deadline = time.perf_counter() + 1.5
        while len(means) < 7 or (time.perf_counter() < deadline and len(means) < 25):
            t = time.perf_counter()
            for _ in range(per_batch):
                fn(*args)
            means.append((time.perf_counter() - t) / per_batch)
    means.sort()
    return means[len(means) // 2]

if mode == "prepare":
    model, args, _ = BUILDERS[model_name]()
    with torch.no_grad():
        ref = model(*args)
    torch.save(model.state_dict(), paths["weights"])
    torch.save({"args": args, "ref": ref}, paths["io"])
    print(json.dumps({"size": os.path.getsize(paths["weights"])}))
    sys.exit(0)

io = torch.load(paths["io"])
args = io["args"]

if mode == "build":
    model = built()
    t = time.perf_counter()
    with torch.no_grad():
        if case == "aot_compile":
            torch._dynamo.config.enable_aot_compile = True
            fn = torch.compile(model, fullgraph=True).forward.aot_compile((args, {}))
            fn.save_compiled_function(paths[case])
        elif case == "aoti":
            ep = torch.export.export(model, args)
            torch._inductor.aoti_compile_and_package(ep, package_path=paths[case])
        elif case == "mega_cache":
            torch.compile(model)(*args)
            data, _ = torch.compiler.save_cache_artifacts()
            with open(paths[case], "wb") as f:
                f.write(data)
        elif case == "precompile":
            code, cache = torch.compiler.precompile(lambda m, *a: m(*a), model, *args)
            with open(paths[case], "w") as f:
                f.write(code)
            with open(paths[case] + ".cache", "wb") as f:
                f.write(cache)
        elif case == "ours":
            from torch_precompile import Precompile
            Precompile.save(paths[case], Precompile.compile(model, args))
    build = time.perf_counter() - t
    size = os.path.getsize(paths[case])
    if case == "precompile":
        size += os.path.getsize(paths[case] + ".cache")
    print(json.dumps({"compile_s": build, "size": size}))
    sys.exit(0)

# mode == "run"
with torch.no_grad():
    if case == "eager":
        fn = built()
        t = time.perf_counter(); out = fn(*args)
    elif case == "jit":
        fn = torch.compile(built())
        t = time.perf_counter(); out = fn(*args)
    elif case == "aot_compile":
        model = built()
        with open(paths[case], "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        fn = lambda *a: loaded(model, *a)
        t = time.perf_counter(); out = fn(*args)
    elif case == "precompile":
        model = built()
        with open(paths[case]) as f:
            code = f.read()
        with open(paths[case] + ".cache", "rb") as f:
            cache = f.read()
        loaded = torch.compiler.precompile.load(code, cache)
        fn = lambda *a: loaded(model, *a)
        t = time.perf_counter(); out = fn(*args)
    elif case == "aoti":
        fn = torch._inductor.aoti_load_package(paths[case])
        t = time.perf_counter(); out = fn(*args)
    elif case == "mega_cache":
        model = built()
        with open(paths[case], "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
        fn = torch.compile(model)
        t = time.perf_counter(); out = fn(*args)
    elif case == "ours":
        from torch_precompile import Precompile
        fn = Precompile.load(paths[case])
        t = time.perf_counter(); out = fn(*args)
    first_done = time.time()
    first_call = time.perf_counter() - t
if isinstance(out, (tuple, list)):
    out = out[0]
diff = (out - io["ref"]).abs().max().item()
extra = {}
if case == "ours":
    extra["fast_path"] = type(fn.compiled_function).__name__ == "LeanCompiledFunction"
print(json.dumps({"first_done": first_done, "first_call_s": first_call, "max_diff": diff,
                  "steady_s": steady(fn, args), **extra}))
'''


def _env(caches: Path, repo: Path) -> dict[str, str]:
    """Environment whose compiler caches and temporary directory live under ``caches``."""
    assert repo == REPO
    return child_env(caches)


def _child(
    script: Path, argv: list[str], env: dict[str, str], timeout: float
) -> tuple[dict[str, Any], float]:
    """Run the child; returns its JSON line and the wall time at which it was started."""
    start = time.time()
    out = run_child([sys.executable, str(script)], *argv, env=env, timeout=timeout)
    line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
    return json.loads(line), start


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def bench_case(
    model: str, case: str, runs: int, work_root: Path, script: Path, timeout: float
) -> dict[str, Any]:
    """Build (if the case has a build step), then time cold and warm runs of one case."""
    work = work_root / model
    print(f"[coldstart] {model}: {case}", file=sys.stderr, flush=True)
    entry: dict[str, Any] = {"label": LABELS[case], "note": FILE_NOTES.get(case, "")}
    warm_caches = work / f"caches-{case}"
    shutil.rmtree(warm_caches, ignore_errors=True)
    if case == "precompile" and not _has_torch_precompile():
        import torch

        entry["skipped"] = f"torch {torch.__version__} has no torch.compiler.precompile"
        print(f"[coldstart] {model}/{case}: {entry['skipped']}", file=sys.stderr)
        return entry
    try:
        if case in ("aot_compile", "precompile", "aoti", "mega_cache", "ours"):
            built, _ = _child(
                script, ["build", case, model, str(work)], _env(warm_caches, REPO), timeout
            )
            entry["compile_s"] = built["compile_s"]
            entry["size_bytes"] = built["size"]
        elif case == "eager":
            entry["compile_s"] = 0.0
            entry["size_bytes"] = (work / "weights.pt").stat().st_size
        for mode in ("cold", "warm"):
            firsts, calls, steadies, diffs, fast = [], [], [], [], []
            if mode == "warm":
                # Untimed: fills the warm caches the way a first deployment run would.
                _child(script, ["run", case, model, str(work)], _env(warm_caches, REPO), timeout)
            for _ in range(runs):
                if mode == "cold":
                    caches = Path(tempfile.mkdtemp(prefix="cold-", dir=work))
                else:
                    caches = warm_caches
                out, start = _child(
                    script, ["run", case, model, str(work)], _env(caches, REPO), timeout
                )
                if mode == "cold":
                    shutil.rmtree(caches, ignore_errors=True)
                firsts.append(out["first_done"] - start)
                calls.append(out["first_call_s"])
                steadies.append(out["steady_s"])
                diffs.append(out["max_diff"])
                if "fast_path" in out:
                    fast.append(out["fast_path"])
            entry[mode] = {
                "first_output_s": _median(firsts),
                "first_output_all_s": firsts,
                "first_call_s": _median(calls),
                "steady_call_s": _median(steadies),
                "max_diff_vs_eager": max(diffs),
            }
            if fast:
                entry[mode]["fast_path"] = all(fast)
        if case == "jit":
            entry["compile_s"] = entry["cold"]["first_call_s"]
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        entry["error"] = str(exc)[-1500:]
        print(f"[coldstart] {model}/{case} failed: {str(exc)[-500:]}", file=sys.stderr)
    return entry


def _has_torch_precompile() -> bool:
    import torch

    return callable(getattr(torch.compiler, "precompile", None))


def import_overhead(runs: int, work_root: Path) -> dict[str, float]:
    """What ``import torch_precompile`` adds to ``import torch``, in fresh processes (median)."""
    env = _env(work_root / "scratch", REPO)
    code = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        "import torch_precompile; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
    )
    torch_s, added_s = [], []
    for _ in range(runs):
        out = run_child(code, env=env).split()
        torch_s.append(float(out[0]))
        added_s.append(float(out[1]))
    return {"import_torch_s": statistics.median(torch_s), "overhead_s": statistics.median(added_s)}


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _fmt_call(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.2f} ms" if v >= 1e-3 else f"{v * 1e6:.1f} µs"


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def table(model: str, res: dict[str, Any]) -> str:
    eager = res.get("eager", {})
    e_cold = eager.get("cold", {}).get("first_output_s")
    e_warm = eager.get("warm", {}).get("first_output_s")
    lines = [
        f"**{model}**",
        "",
        "| case | first output, cold | first output, warm | per call (no_grad) | compile | file |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for entry in res.values():
        if "skipped" in entry:
            lines.append(f"| {entry['label']} | skipped: {entry['skipped']} | | | | |")
            continue
        if "error" in entry:
            lines.append(f"| {entry['label']} | failed: see JSON | | | | |")
            continue
        cold = entry["cold"]["first_output_s"]
        warm = entry["warm"]["first_output_s"]
        ratio = lambda v, e: f" ({v / e:.1f}x)" if v is not None and e else ""  # noqa: E731
        size = _fmt_size(entry.get("size_bytes"))
        if entry.get("note"):
            size += f" ({entry['note']})"
        cells = [
            entry["label"],
            f"{_fmt_s(cold)}{ratio(cold, e_cold)}",
            f"{_fmt_s(warm)}{ratio(warm, e_warm)}",
            _fmt_call(entry["warm"]["steady_call_s"]),
            _fmt_s(entry.get("compile_s")),
            size,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case and mode (median)")
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results" / "coldstart_cpu.json")
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per child process")
    parser.add_argument(
        "--log",
        "--readme",
        dest="log",
        action="store_true",
        help="also add the tables to docs/measurements.md, as a new entry at the top",
    )
    parser.add_argument(
        "--from-json", metavar="JSON", help="only print (and --log) the tables of an earlier run"
    )
    ns = parser.parse_args(argv)
    if ns.from_json:
        report = json.loads(Path(ns.from_json).read_text())
        text = render(report)
        print(text)
        if ns.log:
            add_to_log(text, report)
        return 0
    cases = ["eager", *[c for c in ns.cases if c != "eager"]]  # ratios need eager

    with tempfile.TemporaryDirectory(prefix="tpc-coldstart-") as tmp:
        work_root = Path(tmp)
        script = work_root / "child.py"
        script.write_text(textwrap.dedent(CHILD))
        overhead = import_overhead(max(ns.runs, 5), work_root)
        scratch = _env(work_root / "scratch", REPO)
        for m in ns.models:
            (work_root / m).mkdir(parents=True, exist_ok=True)
            _child(script, ["prepare", "-", m, str(work_root / m)], scratch, ns.timeout)
        results: dict[str, dict[str, Any]] = {m: {} for m in ns.models}
        # Case by case for both models, the JSON rewritten after each: a cut-short run
        # still leaves every finished case.
        for case in cases:
            for m in ns.models:
                results[m][case] = bench_case(m, case, ns.runs, work_root, script, ns.timeout)
                _write_report(ns.out, ns.runs, overhead, results)
    report = json.loads(Path(ns.out).read_text())
    text = render(report)
    print(text)
    if ns.log:
        add_to_log(text, report)
    print(f"wrote {ns.out}")
    return 0


def render(report: dict[str, Any]) -> str:
    """Markdown: one table per model, then the import overhead and the machine."""
    parts = [table(model, res) for model, res in report["results"].items()]
    overhead = report["import_overhead"]
    host = report["machine"]
    load = host.get("load_average")
    cpus = host.get("cpus", host.get("cpu_count"))  # earlier results: cpu_count
    parts.append(
        f"`import torch`: {overhead['import_torch_s']:.2f} s; `import torch_precompile` adds "
        f"{overhead['overhead_s']:.3f} s. Medians of {report['runs']} runs, "
        f"{cpus} CPUs, torch {host['torch']}, Python {host['python']}"
        + (f", load average {load[0]:.1f} at the end" if load else "")
        + f" ({report['created']})."
    )
    return "\n\n".join(parts)


def add_to_log(text: str, report: dict[str, Any]) -> None:
    """Put ``text`` into docs/measurements.md as a new entry, above the newest one."""
    log = REPO / "docs" / "measurements.md"
    day = report["created"][:10]
    host = report["machine"]
    command = " ".join(["python benchmarks/coldstart.py", *sys.argv[1:]])
    cpus = host.get("cpus", host.get("cpu_count", "?"))
    entry = (
        f"### Cold start on the CPU, torch {host['torch']} ({day})\n\n"
        f"*`{command}`; {cpus} CPUs, torch {host['torch']}.*\n\n{text}\n\n"
    )
    content = log.read_text()
    head, dated, rest = content.partition("\n## ")
    if not dated:
        raise SystemExit("docs/measurements.md has no dated section (## YYYY-MM-DD)")
    if rest.startswith(day):  # today's section: the entry goes first in it
        heading, _, body = rest.partition("\n\n")
        log.write_text(f"{head}\n## {heading}\n\n{entry}{body}")
    else:
        log.write_text(f"{head}\n## {day}\n\n{entry}## {rest}")


def _write_report(out: str, runs: int, overhead: dict[str, float], results: dict[str, Any]) -> None:

    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            **machine(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "runs": runs,
        "import_overhead": overhead,
        "results": results,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
