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

from harness import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import time
T0 = time.perf_counter()
import json, sys
import torch
method, path, builder = sys.argv[1], sys.argv[2], sys.argv[3]
from tests.fixtures import models

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

    from tests.fixtures import models
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
    env = child_env(caches)
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


# ---------------------------------------------------------------- cold-start suite
# The reference transformer and Hugging Face decoders started as users start
# them. Every child times its phases from before ``import torch``:
#   eager      import torch; (transformers) import the class; from_pretrained of a
#              local save_pretrained directory (safetensors) in bfloat16, to the GPU;
#              first call (the transformer: build the model, .cuda()).
#   ours       import torch; import torch_precompile; Precompile.load; first call.
#   torch_aot  eager's start, then torch.compiler.load_compiled_function; first call.
# "cold": empty TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR; "warm": caches filled
# by one untimed run. Each child also records which compiler modules it imported.

SUITE_CHILD = r"""
import time
T0 = time.perf_counter()
import json, sys
import torch
phases = {"import_torch": time.perf_counter() - T0}
method, model_name, path, model_dir = sys.argv[1:5]
HEAVY = ("torch._dynamo", "torch._inductor.compile_fx", "sympy", "triton", "triton.compiler",
         "torch._inductor.codegen.wrapper", "torch._functorch._aot_autograd.runtime_wrappers",
         "transformers.models")

def mark(name, start):
    now = time.perf_counter()
    phases[name] = now - start
    return now

def hf_class():
    import transformers
    names = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
    return getattr(transformers, names[model_name])

t = time.perf_counter()
torch.cuda.init()
t = mark("cuda_init", t)
# The same ids in every process (a CPU generator), so that outputs can be compared.
gen = torch.Generator().manual_seed(0)
if model_name == "transformer":
    ids = torch.randint(0, 1000, (2, 32), generator=gen).cuda()
    kwargs = {}
else:
    ids = torch.randint(0, 1000, (2, 64), generator=gen).cuda()
    kwargs = {"use_cache": False}
with torch.no_grad():
    if method in ("eager", "torch_aot"):
        if model_name == "transformer":
            from tests.fixtures import models
            model = models.build_transformer()[0].cuda()
            t = mark("build_model", t)
        else:
            cls = hf_class()
            t = mark("import_model_class", t)
            model = cls.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
            t = mark("from_pretrained", t)
        fn = lambda: model(ids, **kwargs)
        if method == "torch_aot":
            with open(path, "rb") as f:
                loaded = torch.compiler.load_compiled_function(f)
            t = mark("load_compiled_function", t)
            fn = lambda: loaded(model, ids, **kwargs)
    else:
        from torch_precompile import Precompile
        import logging
        LOG = []  # why a load or a call leaves the lean path
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: LOG.append(record.getMessage()[:800])
        logging.getLogger("torch_precompile").addHandler(handler)
        logging.getLogger("torch_precompile").setLevel(logging.INFO)
        t = mark("import_torch_precompile", t)
        art = Precompile.load(path)
        t = mark("load", t)
        fn = lambda: art(ids, **kwargs)
    out = fn()
    torch.cuda.synchronize()
    t = mark("first_call", t)
    first = t - T0
    heavy = [m for m in HEAVY if m in sys.modules]
    lean = method == "ours" and type(art.compiled_function).__name__ == "LeanCompiledFunction"
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t1) / 50
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, tuple) else out)
    torch.save(logits.float().cpu(), sys.argv[5])
res = {"first_output_s": first, "phases": phases, "per_call_ms": per_call * 1e3,
       "heavy_modules": heavy, "lean_load": lean,
       "log": LOG[:6] if method == "ours" else []}
print("RESULT " + json.dumps(res))
"""


def _suite_child(method: str, name: str, path: str, model_dir: str, caches: str) -> dict:
    env = child_env(caches)
    logits = os.path.join(caches, "logits.pt")
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", SUITE_CHILD, method, name, path, model_dir, logits],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        return {"error": f"exit status {proc.returncode}: " + (proc.stderr or proc.stdout)[-1500:]}
    res = json.loads(line[-1][len("RESULT ") :])
    res["wall_s"] = time.perf_counter() - t
    res["logits_path"] = logits
    return res


def _suite_build(name: str, tmp: str) -> dict:
    """The model's artifacts (ours, torch's aot_compile) and, for HF, its save_pretrained dir."""
    import torch

    from torch_precompile import Precompile
    from torch_precompile.file import read_info

    info: dict = {"model_dir": "-"}
    if name == "transformer":
        from tests.fixtures import models

        model = models.build_transformer()[0].cuda()
        ids = torch.randint(0, 1000, (2, 32), device="cuda")
        kwargs: dict = {}
    else:
        import transformers

        torch.manual_seed(0)
        if name == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        else:
            cfg = transformers.LlamaConfig(
                hidden_size=1024,
                intermediate_size=4096,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=4,
                vocab_size=32000,
            )
            model = transformers.LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16).eval()
        info["model_dir"] = os.path.join(tmp, f"{name}_hf")
        model.save_pretrained(info["model_dir"])  # safetensors
        info["parameters"] = sum(p.numel() for p in model.parameters())
        model = model.cuda()
        ids = torch.randint(0, 1000, (2, 64), device="cuda")
        kwargs = {"use_cache": False}
    with torch.no_grad():
        t = time.perf_counter()
        art = Precompile.compile(model, (ids,), kwargs)
        path = os.path.join(tmp, f"{name}.pt2")
        Precompile.save(path, art)
        info["ours"] = {"path": path, "build_s": time.perf_counter() - t}
        info["ours"]["bytes"] = os.path.getsize(path)
        header = read_info(path)
        info["ours"]["lean_file"] = any(sec["name"] == "fastload" for sec in header.sections)
        info["ours"]["fast_load_refusal"] = header.meta["variants"][0].get("fast_load_refusal")
        try:
            t = time.perf_counter()
            torch._dynamo.config.enable_aot_compile = True
            fn = torch.compile(model, fullgraph=True).forward.aot_compile(((ids,), kwargs))
            aot_path = os.path.join(tmp, f"{name}_torch_aot.bin")
            fn.save_compiled_function(aot_path)
            info["torch_aot"] = {"path": aot_path, "build_s": time.perf_counter() - t}
        except Exception as exc:
            info["torch_aot"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return info


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "not run"}
    phases = {k: statistics.median(r["phases"][k] for r in ok) for k in ok[0]["phases"]}
    return {
        "first_output_s": statistics.median(r["first_output_s"] for r in ok),
        "first_output_all_s": [round(r["first_output_s"], 3) for r in ok],
        "phases_median_s": phases,
        "per_call_ms": statistics.median(r["per_call_ms"] for r in ok),
        "heavy_modules": ok[0]["heavy_modules"],
        "lean_load": ok[0]["lean_load"],
        "log": ok[0].get("log", []),
        "errors": [r["error"][:300] for r in runs if "error" in r],
    }


def _max_diff(a_path: str, b_path: str) -> float | None:
    import torch

    try:
        a, b = torch.load(a_path), torch.load(b_path)
    except Exception:
        return None
    return ((a - b).abs().max() / b.abs().max()).item()


def run_suite(names: list[str], repeats: int, out: str | None, deadline_s: float) -> int:
    """The cold-start benchmark: eager vs ours vs torch's aot_compile, cold and warm."""
    import subprocess as sp

    import torch

    start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="coldstart_suite_")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "parent_triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "parent_inductor")
    try:
        driver = sp.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        driver = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report: dict = {
        "device": torch.cuda.get_device_name(0),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "repeats": repeats,
        "models": {},
    }

    def save() -> None:
        if out:
            with open(out, "w") as f:
                json.dump(report, f, indent=1)

    # All artifacts first, then the measurements in order of importance (eager and
    # ours before torch's aot_compile), so that a time limit cuts the least useful.
    infos: dict[str, dict] = {}
    for name in names:
        if time.perf_counter() - start > deadline_s:
            report["models"][name] = {"skipped": "time limit"}
            continue
        info = infos[name] = _suite_build(name, tmp)
        report["models"][name] = {
            "artifacts": {
                k: {kk: vv for kk, vv in v.items() if kk != "path"}
                for k, v in info.items()
                if isinstance(v, dict)
            },
            "parameters": info.get("parameters"),
            "methods": {},
        }
        save()
    ref_logits: dict[str, str] = {}
    for stage in (("eager", "ours"), ("torch_aot",)):
        for name, info in infos.items():
            rep = report["models"][name]
            plan = [("eager", "-", "warm"), ("ours", info["ours"]["path"], "cold")]
            plan.append(("ours", info["ours"]["path"], "warm"))
            if "path" in info.get("torch_aot", {}):
                plan.append(("torch_aot", info["torch_aot"]["path"], "cold"))
                plan.append(("torch_aot", info["torch_aot"]["path"], "warm"))
            for method, path, kind in plan:
                if method not in stage:
                    continue
                runs = []
                shared = tempfile.mkdtemp(dir=tmp)
                if kind == "warm" and method != "eager":
                    _suite_child(method, name, path, info["model_dir"], shared)  # fills caches
                for _ in range(repeats):
                    if time.perf_counter() - start > deadline_s:
                        break
                    caches = tempfile.mkdtemp(dir=tmp) if kind == "cold" else shared
                    runs.append(_suite_child(method, name, path, info["model_dir"], caches))
                if not runs:
                    continue
                summary = _summary(runs)
                logits = [r["logits_path"] for r in runs if "logits_path" in r]
                if method == "eager" and logits:
                    ref_logits[name] = os.path.join(tmp, f"{name}_eager_logits.pt")
                    shutil.copy(logits[0], ref_logits[name])
                elif name in ref_logits and logits:
                    summary["max_diff_rel_to_eager_logit_scale"] = _max_diff(
                        logits[0], ref_logits[name]
                    )
                rep["methods"][f"{method}_{kind}"] = summary
                print(name, method, kind, summary.get("first_output_all_s"), flush=True)
                _ratios(rep)
                save()
    print(suite_markdown(report))
    if out:
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(suite_markdown(report) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _ratios(rep: dict) -> None:
    """Each method's time to first output against eager's, and its load against
    eager's ``from_pretrained`` (HF models)."""
    eager = rep["methods"].get("eager_warm", {})
    for m in rep["methods"].values():
        if "first_output_s" in m and "first_output_s" in eager:
            m["vs_eager_first_output"] = m["first_output_s"] / eager["first_output_s"]
    base = eager.get("phases_median_s", {}).get("from_pretrained")
    if base:
        for key, m in rep["methods"].items():
            if key.startswith("ours") and "load" in m.get("phases_median_s", {}):
                m["load_vs_eager_from_pretrained"] = m["phases_median_s"]["load"] / base


def suite_markdown(report: dict) -> str:
    """The README's CUDA table from the suite's JSON."""
    lines = [
        f"{report['device']}, driver {report['driver']}, torch {report['torch']} (CUDA "
        f"{report['cuda']}), Triton {report['triton']}, Python {report['python']}, "
        f"{report['date']}; medians of {report['repeats']} fresh processes, time from before "
        "`import torch` to a synchronised first output.",
        "",
        "| model | method | cache | first output | x eager | load phases (median s) "
        "| per call | heavy modules imported |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    for name, rep in report["models"].items():
        for key, m in rep.get("methods", {}).items():
            method, kind = key.rsplit("_", 1)
            if "first_output_s" not in m:
                lines.append(f"| {name} | {method} | {kind} | {m.get('error', '')[:60]} | | | | |")
                continue
            phases = ", ".join(
                f"{k} {v:.2f}" for k, v in m["phases_median_s"].items() if k != "import_torch"
            )
            phases = f"import torch {m['phases_median_s']['import_torch']:.2f}, " + phases
            ratio = m.get("vs_eager_first_output")
            heavy = ", ".join(m["heavy_modules"]) or "none"
            lines.append(
                f"| {name} | {method} | {kind} | {m['first_output_s']:.2f} s | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | {phases} | "
                f"{m['per_call_ms']:.2f} ms | {heavy} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="transformer",
        help="builder name without build_ (tests/fixtures/models.py)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(LABELS))
    parser.add_argument(
        "--out", default=None, help="JSON report path (a .md table is written beside it)"
    )
    parser.add_argument(
        "--combine", nargs="+", default=None, help="merge JSON reports of runs of other methods"
    )
    parser.add_argument(
        "--suite",
        default=None,
        help="comma-separated models (transformer, gpt2, llama), eager vs ours vs "
        "torch aot_compile as users start them",
    )
    parser.add_argument("--deadline", type=float, default=480.0, help="suite: seconds")
    opts = parser.parse_args()
    if opts.suite:
        sys.path.insert(0, ROOT)
        return run_suite(opts.suite.split(","), opts.repeats, opts.out, opts.deadline)
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
