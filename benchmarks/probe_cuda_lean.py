"""Device probe (issue 16): save CUDA artifacts and dump Inductor's wrapper and Triton launch state.

Writes into the directory given as argv[1]: the torch runtime sources this torch
uses for static launches, each artifact, each graph's wrapper source and, per
Triton kernel, its autotuner's state after a first call.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback

import torch

from examples.models import build_gpt, build_transformer
from torch_precompile import Precompile

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
info = {
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name(0),
}
try:
    import triton

    info["triton"] = triton.__version__
except Exception as exc:  # noqa: BLE001
    info["triton"] = repr(exc)
root = os.path.dirname(torch.__file__)
for rel in (
    "_inductor/runtime/static_triton_launcher.py",
    "_inductor/runtime/triton_heuristics.py",
    "_inductor/async_compile.py",
    "_inductor/codegen/wrapper.py",
    "_inductor/triton_bundler.py",
    "_inductor/runtime/triton_compat.py",
    "_inductor/output_code.py",
    "_functorch/_aot_autograd/runtime_wrappers.py",
    "_dynamo/aot_compile.py",
):
    src = os.path.join(root, rel)
    if os.path.exists(src):
        shutil.copy(src, os.path.join(out, rel.replace("/", "__")))
print(json.dumps(info), flush=True)


def dump(name: str, art, example) -> None:
    fn = art.compiled_function
    try:
        entry = fn._artifacts.compiled_fn.compiled_fn.serialize()
    except Exception:
        traceback.print_exc()
        return
    from torch._inductor.codecache import PyCodeCache

    for part in ("compiled_fw", "compiled_bw"):
        graph = getattr(getattr(entry, part, None), "result", None)
        if graph is None:
            continue
        src = graph.source_code
        with open(os.path.join(out, f"{name}.{part}.py"), "w") as f:
            f.write(src)
        mod = PyCodeCache.load(src)
        rows = {}
        for k, v in vars(mod).items():
            if type(v).__name__ not in (
                "CachingAutotuner",
                "DebugAutotuner",
                "StaticAutotunerFuture",
            ):
                continue
            row = {"type": type(v).__name__, "n_launchers": len(getattr(v, "launchers", []))}
            crs = getattr(v, "compile_results", None) or []
            row["compile_results"] = [type(c).__name__ for c in crs]
            row["configs"] = [str(c) for c in (getattr(v, "configs", None) or [])]
            row["attrs"] = {a: repr(b)[:300] for a, b in vars(v).items()}
            if getattr(v, "launchers", None):
                la = v.launchers[0]
                row["launcher_attrs"] = {
                    a: repr(getattr(la, a, None))[:200]
                    for a in ("config", "cache_hash", "_is_static", "shared", "n_regs")
                }
            if crs:
                c = crs[0]
                kern = c.kernel
                row["kernel_type"] = type(kern).__name__
                row["kernel_dict"] = (
                    {a: repr(b)[:300] for a, b in vars(kern).items()}
                    if hasattr(kern, "__dict__")
                    else None
                )
                row["inductor_meta"] = repr(c.inductor_meta)[:1500]
                row["compile_meta_keys"] = sorted(c.compile_meta)
            rows[k] = row
        if True:
            pass
        with open(os.path.join(out, f"{name}.{part}.kernels.json"), "w") as f:
            json.dump(rows, f, indent=1)
        has_get_args = hasattr(mod, "get_args")
        print(name, part, "kernels", len(rows), "get_args", has_get_args, flush=True)


for name, builder, training in (
    ("transformer-infer", build_transformer, False),
    ("gpt-train", build_gpt, True),
):
    try:
        model, args, _ = builder()
        model = model.cuda()
        args = tuple(a.cuda() for a in args)
        if training:
            model.train()
            art = Precompile.compile(model, args)
            art(*args)[0].sum().backward() if isinstance(art(*args), tuple) else art(
                *args
            ).float().sum().backward()
        else:
            with torch.no_grad():
                art = Precompile.compile(model, args)
                art(*args)
        Precompile.save(os.path.join(out, f"{name}.pt2"), art)
        dump(name, art, args)
    except Exception:
        traceback.print_exc()
tc = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
print("triton cache", tc, sum(len(f) for _, _, f in os.walk(tc)) if os.path.isdir(tc) else None)
