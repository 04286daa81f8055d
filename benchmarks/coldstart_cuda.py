"""Cold start on CUDA: time to first output in a fresh process, per method.

Methods (inference, ``torch.no_grad``), each run in a new Python process:

- ``eager``: import torch, build the model, move it to the GPU, first call.
- ``torch.compile``: the same plus JIT compilation at the first call.
- ``torch aot_compile``: load a file written by PyTorch's own
  ``torch.compile(...).forward.aot_compile`` + ``save_compiled_function``
  (``torch.compiler.load_compiled_function``; needs the live model).
- ``AOTInductor``: ``aoti_load_package`` of a package from
  ``torch._inductor.aoti_compile_and_package`` (weights inside).
- ``torch_precompile``: ``Precompile.load`` (weights inside), default mode and
  ``mode="reduce-overhead"`` (CUDA graphs).

"cold" runs each start with empty ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR``
(what a new machine or container sees); "warm" runs reuse caches filled by one
untimed run first. Time to first output is measured inside the child from before
``import torch`` to a synchronised first output: median of ``--repeats`` runs.
Per-call is the steady-state time of one call (mean of 100 calls after 20 warm-up
calls, synchronised), median over the runs.

Usage (repository root, a CUDA machine)::

    python benchmarks/coldstart_cuda.py --model transformer --out results.json
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import time
T0 = time.perf_counter()
import json, sys
import torch
method, path, builder = sys.argv[1], sys.argv[2], sys.argv[3]
from examples import models

def build():
    model, args, _ = getattr(models, builder)()
    return model.cuda(), tuple(a.cuda() for a in args)

with torch.no_grad():
    if method == "eager":
        model, args = build()
        fn = model
    elif method == "jit":
        model, args = build()
        fn = torch.compile(model)
    elif method == "torch_aot":
        model, args = build()
        with open(path, "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        fn = lambda *a: loaded(model, *a)
    elif method == "aoti":
        _, args = build()
        fn = torch._inductor.aoti_load_package(path)
    elif method in ("ours", "ours_cg"):
        from torch_precompile import Precompile
        _, args = build()
        fn = Precompile.load(path)
    out = fn(*args)
    torch.cuda.synchronize()
    first = time.perf_counter() - T0
    out = out.clone()  # CUDA graphs (reduce-overhead) overwrite outputs on the next call
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        fn(*args)
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t) / 100
    ref_model, ref_args = build()
    diff = (out.float() - ref_model(*ref_args).float()).abs().max().item()
res = {"first_output_s": first, "per_call_ms": per_call * 1e3, "max_abs_diff": diff}
print("RESULT " + json.dumps(res))
"""

LABELS = {
    "eager": "eager (no compile)",
    "jit": "torch.compile (JIT)",
    "torch_aot": "torch aot_compile + load_compiled_function",
    "aoti": "AOTInductor (aoti_load_package)",
    "ours": "torch_precompile (Precompile.load)",
    "ours_cg": 'torch_precompile, mode="reduce-overhead"',
}


def build_artifacts(builder: str, tmp: str, methods: list[str]) -> dict[str, dict]:
    """Compile each ahead-of-time artifact in ``methods`` once, in this process (own caches)."""
    import torch

    from examples import models
    from torch_precompile import Precompile

    info: dict[str, dict] = {"eager": {"path": "-"}, "jit": {"path": "-"}}
    model, args, _ = getattr(models, builder)()
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    with torch.no_grad():
        for method, mode in (("ours", None), ("ours_cg", "reduce-overhead")):
            if method not in methods:
                continue
            t = time.perf_counter()
            art = Precompile.compile(model, args, mode=mode)
            path = os.path.join(tmp, f"{method}.pt")
            Precompile.save(path, art)
            info[method] = {
                "path": path,
                "build_s": time.perf_counter() - t,
                "bytes": os.path.getsize(path),
            }
        try:
            if "torch_aot" not in methods:
                raise LookupError("not requested")
            t = time.perf_counter()
            torch._dynamo.config.enable_aot_compile = True
            fn = torch.compile(model, fullgraph=True).forward.aot_compile((args, {}))
            path = os.path.join(tmp, "torch_aot.bin")
            fn.save_compiled_function(path)
            info["torch_aot"] = {
                "path": path,
                "build_s": time.perf_counter() - t,
                "bytes": os.path.getsize(path),
            }
        except Exception as exc:
            info["torch_aot"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        try:
            if "aoti" not in methods:
                raise LookupError("not requested")
            t = time.perf_counter()
            ep = torch.export.export(model, args)
            path = torch._inductor.aoti_compile_and_package(
                ep, package_path=os.path.join(tmp, "model.pt2")
            )
            info["aoti"] = {
                "path": path,
                "build_s": time.perf_counter() - t,
                "bytes": os.path.getsize(path),
            }
        except Exception as exc:
            info["aoti"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {k: v for k, v in info.items() if k in methods}


def run_child(method: str, path: str, builder: str, caches: str) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        TRITON_CACHE_DIR=os.path.join(caches, "triton"),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
    )
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, method, path, builder],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    wall = time.perf_counter() - t
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        return {
            "error": f"exit status {proc.returncode}: " + (proc.stderr or proc.stdout)[-1500:],
            "wall_s": wall,
        }
    res = json.loads(line[-1][len("RESULT ") :])
    res["wall_s"] = wall
    res["returncode"] = proc.returncode  # a crash at interpreter exit is recorded, not hidden
    return res


def measure(method: str, path: str, builder: str, tmp: str, repeats: int) -> dict:
    out: dict = {}
    for kind in ("cold", "warm"):
        runs = []
        shared = tempfile.mkdtemp(dir=tmp)
        if kind == "warm":
            run_child(method, path, builder, shared)  # fills the caches, untimed
        for _ in range(repeats):
            caches = tempfile.mkdtemp(dir=tmp) if kind == "cold" else shared
            runs.append(run_child(method, path, builder, caches))
            if kind == "cold":
                shutil.rmtree(caches, ignore_errors=True)
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            out[kind] = {"error": errors[0]}
            continue
        out[kind] = {
            "first_output_s": statistics.median(r["first_output_s"] for r in runs),
            "first_output_all_s": [round(r["first_output_s"], 3) for r in runs],
            "per_call_ms": statistics.median(r["per_call_ms"] for r in runs),
            "max_abs_diff": max(r["max_abs_diff"] for r in runs),
        }
        print(f"  {method} {kind}: {out[kind]['first_output_all_s']}", flush=True)
    return out


def fmt_size(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:.1f} MiB"


def markdown(report: dict) -> str:
    lines = [
        f"Model `{report['model']}`, inference, on {report['gpu']} ({report['date']}, "
        f"torch {report['torch']}, "
        f"Triton {report['triton']}); median of {report['repeats']} fresh processes.",
        "",
        "| method | cold: first output | warm: first output | per call (cold / warm runs) "
        "| file | build |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, label in LABELS.items():
        r = report["methods"].get(method, {})
        info = report["artifacts"].get(method, {})
        if not r and "error" not in info:
            continue
        if "error" in info:
            lines.append(f"| {label} | failed to build: {info['error'][:80]} | | | | |")
            continue

        def cell(kind: str, r: dict = r) -> str:
            m = r.get(kind, {})
            if "error" in m:
                return "crash (SIGSEGV)" if m["error"].startswith("exit status -11") else "error"
            return f"{m['first_output_s']:.2f} s" if m else "-"

        # Per call: the medians of the cold runs and of the warm runs (launch-bound, noisy).
        calls = [
            f"{r[k]['per_call_ms']:.3f}" for k in ("cold", "warm") if "per_call_ms" in r.get(k, {})
        ]
        per_call = " / ".join(calls) + " ms" if calls else "-"
        build = f"{info['build_s']:.1f} s" if "build_s" in info else "-"
        lines.append(
            f"| {label} | {cell('cold')} | {cell('warm')} | {per_call} "
            f"| {fmt_size(info.get('bytes'))} | {build} |"
        )
    return "\n".join(lines)


def combine(paths: list[str], out: str | None) -> int:
    """One table from reports of the same model measured in several runs (``--methods``)."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    merged = dict(reports[0])
    merged["artifacts"] = {}
    merged["methods"] = {}
    for r in reports:
        merged["artifacts"].update({k: v for k, v in r["artifacts"].items() if k in r["methods"]})
        merged["methods"].update(r["methods"])
    merged["runs"] = [
        {"date": r["date"], "gpu": r["gpu"], "methods": list(r["methods"])} for r in reports
    ]
    table = markdown(merged)
    print(table)
    if out:
        with open(out, "w") as f:
            json.dump(merged, f, indent=1)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="transformer", help="builder name without build_ (examples/models.py)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(LABELS))
    parser.add_argument(
        "--out", default=None, help="JSON report path (a .md table is written beside it)"
    )
    parser.add_argument(
        "--combine", nargs="+", default=None, help="merge JSON reports of runs of other methods"
    )
    opts = parser.parse_args()
    if opts.combine:
        return combine(opts.combine, opts.out)
    sys.path.insert(0, ROOT)
    builder = f"build_{opts.model}"
    tmp = tempfile.mkdtemp(prefix="coldstart_cuda_")
    # The parent's compiles use their own caches, never the children's.
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "parent_triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "parent_inductor")
    import torch
    import triton

    methods = opts.methods.split(",")
    info = build_artifacts(builder, tmp, methods)
    print(
        "built:",
        json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in info.items()}),
        flush=True,
    )
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        del os.environ[key]
    run_child("eager", "-", builder, tempfile.mkdtemp(dir=tmp))  # page in torch once, untimed
    report = {
        "model": opts.model,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "repeats": opts.repeats,
        "artifacts": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in info.items()},
        "methods": {},
    }
    for method in methods:
        if "path" not in info.get(method, {}):
            continue
        report["methods"][method] = measure(
            method, info[method]["path"], builder, tmp, opts.repeats
        )
        if opts.out:  # partial results survive a time limit
            with open(opts.out, "w") as f:
                json.dump(report, f, indent=1)
    table = markdown(report)
    print(table)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:
            f.write(table + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
