"""The precompile flow on CUDA: compile, save, cold load in a fresh process, compare with eager.

Cases: the transformer and the GPT-style decoder from ``tests/fixtures/models.py``, for
inference (no_grad) and training (forward + backward, gradients compared), with the
default Inductor mode and with ``mode="reduce-overhead"`` (CUDA graphs); and graphs
that write their inputs (a static KV cache step, BatchNorm training). Each artifact
is built through the staged API (``dynamo -> aot_autograd -> inductor -> precompile``),
checked against eager in the compiling process, saved, then loaded in a fresh
process with empty ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR``. That process
counts calls to ``triton.compile`` (with ``TORCHINDUCTOR_COMPILE_THREADS=1`` every
kernel load happens in-process, so the count is complete) and Inductor's kernel
counters, so "a cold load compiles nothing" is measured, not assumed.

Usage (repository root, a CUDA machine)::

    python benchmarks/cuda_flow.py [--out report.json] [--cases transformer-infer,gpt-train]

Prints one JSON report (and writes it to ``--out``); exits 1 if a case fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback

from harness import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE_DIR = os.environ.get("CUDA_FLOW_PROFILE_DIR")  # cProfile of the cold loads, if set

# (name, builder, training, mode)
CASES = [
    ("transformer-infer", "build_transformer", False, None),
    ("transformer-train", "build_transformer", True, None),
    ("gpt-infer", "build_gpt", False, None),
    ("gpt-train", "build_gpt", True, None),
    ("transformer-infer-cudagraphs", "build_transformer", False, "reduce-overhead"),
    ("gpt-train-cudagraphs", "build_gpt", True, "reduce-overhead"),
    # Input mutations in the graph (a static KV cache, BatchNorm's running statistics).
    ("kvcache-infer", "build_kv_cache_step", False, None),
    ("kvcache-infer-cudagraphs", "build_kv_cache_step", False, "reduce-overhead"),
    ("convnet-train", "build_convnet_train", True, None),
]
TOL = {"rtol": 2e-3, "atol": 2e-3}  # TF32 is off by default; Triton's fused reductions reorder sums

# Runs in a fresh interpreter: argv = artifact path, builder, training, mode.
CHILD = r"""
import time
T0 = time.perf_counter()
import json, os, sys, traceback
# Who first imports a module the lean load must not import (a stack per module).
FIRST_IMPORT = {}
class _TraceImports:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch._dynamo", "sympy", "triton") and name not in FIRST_IMPORT:
            FIRST_IMPORT[name] = "".join(traceback.format_stack(limit=30)[:-1])[-2500:]
        return None
sys.meta_path.insert(0, _TraceImports())
import torch
T_TORCH = time.perf_counter() - T0
PROFILE = os.environ.get("CUDA_FLOW_PROFILE")
if PROFILE:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
path, builder, training, mode = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
LEAN_FILE = os.environ.get("CUDA_FLOW_LEAN_FILE") == "1"  # the file has a lean section
calls = {"triton.compile": 0}
if not LEAN_FILE:  # the full path: count Triton compiles (a lean load never imports Triton)
    import triton
    _orig = triton.compile
    def _counting(*a, **k):
        calls["triton.compile"] += 1
        return _orig(*a, **k)
    triton.compile = _counting
    import triton.compiler.compiler as _tcc
    _tcc.compile = _counting
# What a lean load must not import, checked after load and the first call.
HEAVY = ("torch._dynamo", "torch._inductor.compile_fx", "sympy", "triton", "triton.compiler",
         "torch._inductor.codegen.wrapper", "torch._inductor.runtime.triton_heuristics",
         "torch._functorch._aot_autograd.runtime_wrappers")

from torch_precompile import Precompile
from tests.fixtures import models
import logging
LOG = []  # the package's INFO lines (why a variant or a call leaves the lean path)
_handler = logging.Handler(logging.INFO)
_handler.emit = lambda record: LOG.append(record.getMessage()[:800])
logging.getLogger("torch_precompile").addHandler(_handler)
logging.getLogger("torch_precompile").setLevel(logging.INFO)

TOL = json.loads(sys.argv[5])
T_PKG = time.perf_counter() - T0
art = Precompile.load(path)
t_load = time.perf_counter() - T0
model, args, kwargs = getattr(models, builder)()
model = model.cuda()
args = tuple(a.cuda() for a in args)
res = {"import_torch_s": T_TORCH, "import_package_s": T_PKG, "load_s": t_load,
       "lean_file": LEAN_FILE,
       "lean_load": type(art.compiled_function).__name__ == "LeanCompiledFunction"}

def fresh_input(a):
    # A new input like a: token ids, a cache position (KV cache), or values.
    if a.is_floating_point():
        return torch.randn_like(a)
    high = 16 if builder == "build_kv_cache_step" else 500
    return torch.randint_like(a, 0, high)

def loss_of(out):
    return out.float().pow(2).mean()

if training:
    out = art(*args)
    loss_of(out).backward()
    torch.cuda.synchronize()
    res["first_output_s"] = time.perf_counter() - T0
    out = out.detach().clone()
    ref = model(*args)
    loss_of(ref).backward()
    torch.testing.assert_close(out, ref.detach(), **TOL)
    got = dict(art.module.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, **TOL, msg=lambda m: f"grad {name}: {m}")
        n += 1
    res["grads_compared"] = n
    res["max_abs_diff"] = (out - ref.detach()).abs().max().item()
else:
    with torch.no_grad():
        out = art(*args)
        torch.cuda.synchronize()
        res["first_output_s"] = time.perf_counter() - T0
        out = out.clone()
        ref = model(*args)
    torch.testing.assert_close(out, ref, **TOL)
    res["max_abs_diff"] = (out - ref).abs().max().item()

res["heavy_modules_after_first_call"] = [m for m in HEAVY if m in sys.modules]
res["log"] = LOG[:10]
res["first_heavy_imports"] = dict(FIRST_IMPORT)
_gm = getattr(getattr(art.compiled_function, "_artifacts", None), "guard_manager", None)
res["light_guards"] = getattr(_gm, "lean_guards", None) is not None
if PROFILE:
    prof.disable()
    import io, pstats
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
    with open(PROFILE, "w") as f:
        f.write(buf.getvalue())
# Repeated calls on fresh inputs (CUDA graphs replay; outputs must still be right).
ctx = torch.enable_grad() if training else torch.no_grad()
with ctx:
    for i in range(3):
        x = tuple(fresh_input(a) for a in args)
        o = art(*x)
        if training:
            loss_of(o).backward()
        o = o.detach().clone()
        torch.testing.assert_close(o, model(*x).detach(), **TOL)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(50):
        o = art(*args)
        if training:  # a training step: forward and backward
            loss_of(o).backward()
    torch.cuda.synchronize()
    res["per_call_ms"] = (time.perf_counter() - t) / 50 * 1e3

from torch._dynamo.utils import counters
res["triton_compile_calls"] = (
    calls["triton.compile"] if not LEAN_FILE or "triton" not in sys.modules else None
)
res["inductor_counters"] = {k: v for k, v in counters["inductor"].items()
                            if "compile" in k or "triton" in k or "cudagraph" in k}
tdir = os.environ["TRITON_CACHE_DIR"]
res["triton_cache_files_after"] = sum(len(f) for _, _, f in os.walk(tdir))
if mode == "reduce-overhead" and res["lean_load"]:
    from torch_precompile.lean import cudagraphs as lean_cudagraphs
    res["cudagraphs_recorded"] = lean_cudagraphs.STATS["recorded"]
    res["cudagraph_replays"] = lean_cudagraphs.STATS["replayed"]
    # An output of an earlier call, overwritten by a later replay, raises on access.
    with torch.no_grad():
        first = art(*args)
        art(*args)
    try:
        first.sum()
        res["overwritten_output_raises"] = False
    except RuntimeError as exc:
        res["overwritten_output_raises"] = "overwritten" in str(exc)
elif mode == "reduce-overhead":
    from torch._inductor import cudagraph_trees
    tm = cudagraph_trees.get_container(0).tree_manager
    res["cudagraphs_recorded"] = 0 if tm is None else sum(len(v) for v in tm.roots.values())
print("RESULT " + json.dumps(res))
"""


def per_call_ms(fn, args, training: bool, n: int = 50) -> float:
    """Steady-state time of one call (one forward and backward when training)."""
    import torch

    ctx = torch.enable_grad() if training else torch.no_grad()
    with ctx:
        for _ in range(5):
            o = fn(*args)
            if training:
                o.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            o = fn(*args)
            if training:
                o.float().pow(2).mean().backward()
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def torch_compile_steps(builder: str, training: bool, mode: str, n: int = 4) -> str:
    """The same calls through torch.compile(mode=...): "ok" or "<Error>: message"."""
    import torch

    from tests.fixtures import models

    model, args, _ = getattr(models, builder)()
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    fn = torch.compile(model, mode=mode)
    try:
        with torch.enable_grad() if training else torch.no_grad():
            for _ in range(n):
                o = fn(*args)
                if training:
                    o.float().pow(2).mean().backward()
        torch.cuda.synchronize()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "ok"


def cudagraphs_recorded() -> int:
    """CUDA graphs recorded so far on device 0 (Inductor's cudagraph trees)."""
    from torch._inductor import cudagraph_trees

    tm = cudagraph_trees.get_container(0).tree_manager
    return 0 if tm is None else sum(len(v) for v in tm.roots.values())


def run_case(name: str, builder: str, training: bool, mode: str | None, tmp: str) -> dict:
    import torch

    from tests.fixtures import models
    from torch_precompile import Precompile
    from torch_precompile.file import read_info

    rep: dict = {"case": name, "training": training, "mode": mode}
    model, args, _ = getattr(models, builder)()
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    ctx = torch.enable_grad() if training else torch.no_grad()
    t = time.perf_counter()
    with ctx:
        gm, bytecode, guards = Precompile.dynamo(model, args)
        joint, guards = Precompile.aot_autograd(gm, guards)
        compiled, guards = Precompile.inductor(joint, guards, mode=mode)
        art = Precompile.precompile(compiled)
    rep["compile_s"] = time.perf_counter() - t
    rep["artifact_training"] = art.training
    # Same-process check against eager.
    with ctx:
        out = art(*args)
        if training:
            out.float().pow(2).mean().backward()
            got = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            ref = model(*args)
            ref.float().pow(2).mean().backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(got[n], p.grad, **TOL)
            model.zero_grad()
        else:
            out = out.clone()
            ref = model(*args)
        torch.testing.assert_close(out.detach(), ref.detach(), **TOL)
    path = os.path.join(tmp, f"{name}.pt")
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: records.append(r.getMessage()[:500])  # type: ignore[method-assign]
    logger = logging.getLogger("torch_precompile")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        Precompile.save(path, art, bytecode, guards)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    rep["save_log"] = [r for r in records if "guard" in r or "fast" in r or "kernel" in r][:10]
    rep["file_bytes"] = os.path.getsize(path)
    info = read_info(path)
    rep["lean_file"] = any(sec["name"] == "fastload" for sec in info.sections)
    rep["fast_load_refusal"] = info.meta["variants"][0].get("fast_load_refusal")
    aot_out = joint.meta["torch_precompile_stage_output"]  # the AOTAutogradOutput
    rep["static_input_indices"] = len(
        aot_out._handoff.joint._aot_state.fw_metadata.static_input_indices or []
    )
    if mode == "reduce-overhead":
        with ctx:
            for _ in range(3):
                o = art(*args)
                if training:
                    o.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        rep["cudagraphs_recorded_in_compiling_process"] = cudagraphs_recorded()
        rep["per_call_ms_in_compiling_process"] = per_call_ms(art, args, training)
        # The baseline: torch.compile with the same mode, same process.
        before = cudagraphs_recorded()
        tc = torch.compile(model, mode=mode)
        with ctx:
            for _ in range(3):
                o = tc(*args)
                if training:
                    o.float().pow(2).mean().backward()
        rep["torch_compile_cudagraphs_recorded"] = cudagraphs_recorded() - before
        rep["torch_compile_per_call_ms"] = per_call_ms(tc, args, training)
        from torch._dynamo.utils import counters

        rep["compiling_process_counters"] = {
            k: v for k, v in counters["inductor"].items() if "cudagraph" in k
        }

    caches = tempfile.mkdtemp(dir=tmp)
    env = child_env(caches, TORCHINDUCTOR_COMPILE_THREADS="1")
    env["CUDA_FLOW_LEAN_FILE"] = "1" if rep["lean_file"] else "0"
    if mode == "reduce-overhead":
        env["TORCH_LOGS"] = "cudagraphs"
    if PROFILE_DIR and not training and mode is None:
        env["CUDA_FLOW_PROFILE"] = os.path.join(PROFILE_DIR, f"profile_{name}.txt")
    t = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            path,
            builder,
            "1" if training else "0",
            mode or "default",
            json.dumps(TOL),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    rep["fresh_process_wall_s"] = time.perf_counter() - t
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        rep["ok"] = False
        rep["error"] = (proc.stderr or proc.stdout)[-3000:]
        return rep
    rep["fresh"] = json.loads(line[-1][len("RESULT ") :])
    if mode == "reduce-overhead":
        logs = [ln for ln in proc.stderr.splitlines() if "cudagraph" in ln.lower()]
        rep["fresh_cudagraph_log"] = [ln[:300] for ln in logs[:15]]
    rep["ok"] = True
    return rep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default=None, help="comma-separated case names")
    opts = parser.parse_args()
    sys.path.insert(0, ROOT)
    import torch

    wanted = set(opts.cases.split(",")) if opts.cases else None
    report = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "cases": [],
    }
    tmp = tempfile.mkdtemp(prefix="cuda_flow_")
    for name, builder, training, mode in CASES:
        if wanted and name not in wanted:
            continue
        try:
            rep = run_case(name, builder, training, mode, tmp)
        except Exception as exc:  # report every case, not only the first failure
            rep = {"case": name, "training": training, "mode": mode, "ok": False}
            rep["error"] = "".join(traceback.format_exception(exc))[-3000:]
            if mode == "reduce-overhead":
                rep["torch_compile_same_mode"] = torch_compile_steps(builder, training, mode)
                rep["same_failure_as_torch_compile"] = (
                    rep["torch_compile_same_mode"].split(":")[0] == type(exc).__name__
                )
        print(json.dumps(rep), flush=True)
        report["cases"].append(rep)
    text = json.dumps(report, indent=1)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)
    print("SUMMARY")
    nan = float("nan")
    for c in report["cases"]:
        fresh = c.get("fresh", {})
        if not c.get("ok") and "torch_compile_same_mode" in c:
            mode = c.get("mode")
            print(f"{c['case']:30s} ok=False; torch.compile(mode={mode!r}) on the same calls: ")
            print(f"    {c['torch_compile_same_mode'][:160]}")
            continue
        line = (
            f"{c['case']:30s} ok={c.get('ok')} compile={c.get('compile_s', 0):.1f}s "
            f"first_output(cold)={fresh.get('first_output_s', nan):.2f}s "
            f"triton.compile calls={fresh.get('triton_compile_calls')} "
            f"per_call={fresh.get('per_call_ms', nan):.3f}ms "
            f"cudagraphs={fresh.get('cudagraphs_recorded')} lean={fresh.get('lean_load')} "
            f"heavy={fresh.get('heavy_modules_after_first_call')}"
        )
        if c.get("mode"):
            line += (
                f" | in compiling process: {c.get('per_call_ms_in_compiling_process', nan):.3f}ms,"
                f" torch.compile same mode: {c.get('torch_compile_per_call_ms', nan):.3f}ms"
                f" graphs={c.get('torch_compile_cudagraphs_recorded')}"
            )
        print(line)
    return (
        0
        if all(c.get("ok") or c.get("same_failure_as_torch_compile") for c in report["cases"])
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
