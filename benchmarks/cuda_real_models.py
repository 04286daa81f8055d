"""Hugging Face decoders in bfloat16 on CUDA: compile, save, load in a fresh process, compare.

Models (random weights from configs, nothing downloaded), inference under
``torch.no_grad()`` with ``use_cache=False``, input ids of batch 2 x sequence 64:

- ``gpt2``: ``GPT2LMHeadModel(GPT2Config())``, GPT-2 small (124M parameters).
- ``llama``: ``LlamaForCausalLM`` with hidden 1024, MLP 4096, 28 layers, 16 query
  and 4 key/value heads (GQA), RoPE, vocabulary 32000: about 0.49B parameters.

Each model is cast to bfloat16 on the GPU and built through the staged API
(``dynamo -> aot_autograd -> inductor -> precompile``, each stage timed), checked
against eager in the compiling process, saved, then loaded by ``Precompile.load``
in a fresh interpreter that never constructs the model (it imports transformers,
as the saved code refers to it) with empty ``TRITON_CACHE_DIR`` and
``TORCHINDUCTOR_CACHE_DIR``. That process counts ``triton.compile`` calls (with
``TORCHINDUCTOR_COMPILE_THREADS=1`` every kernel load is in-process).

Tolerance. Eager bf16 rounds every intermediate to bfloat16 (8 bits of mantissa,
a relative step of 2**-8 = 0.4%); Inductor's fused kernels keep intermediates in
float32 and reorder sums, so the two differ by rounding noise that grows with
depth; no fixed tolerance fits a 12- and a 28-layer model alike. The yardstick
is bf16's own noise on the model: eager bf16 against eager float32 of the same
weights, measured as the largest absolute logit difference relative to the
logit scale, ``max|a - b| / max|b|``. The loaded artifact must be within
``NOISE_FACTOR`` (2) times that noise of eager bf16, and no further from eager
float32 than ``ACCURACY_FACTOR`` (1.5) times eager bf16 is: as accurate as eager
bf16, with a margin. Max absolute differences and top-1 token agreement are
reported too.

Usage (repository root, a CUDA machine)::

    python benchmarks/cuda_real_models.py [--models gpt2,llama] [--out report.json]
    python benchmarks/cuda_real_models.py --device cpu --small  # a smoke test, no GPU

Prints one JSON report (and writes it to ``--out``); exits 1 if a model fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

from harness import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE_FACTOR = 2.0
ACCURACY_FACTOR = 1.5
BATCH, SEQ = 2, 64

# Runs in a fresh interpreter: argv = artifact path, inputs path, reference logits path.
CHILD = r"""
import time
T0 = time.perf_counter()
import json, sys
import torch
T_TORCH = time.perf_counter() - T0
path, inputs_path, ref_path, ref32_path, device = sys.argv[1:6]
calls = {"triton.compile": 0, "seconds": 0.0, "kernels": []}
if device == "cuda":
    import triton
    _orig = triton.compile
    def _counting(*a, **k):
        calls["triton.compile"] += 1
        calls["kernels"].append(str(getattr(a[0], "name", type(a[0]).__name__)))
        t = time.perf_counter()
        try:
            return _orig(*a, **k)
        finally:
            calls["seconds"] += time.perf_counter() - t
    triton.compile = _counting
    import triton.compiler.compiler as _tcc
    _tcc.compile = _counting
# The model is never constructed here: record the library modules built all the same
# (transformers.activations builds a few at import; no transformers.models.* class).
built = []
_module_init = torch.nn.Module.__init__
def _counting_init(self, *a, **k):
    if type(self).__module__.startswith("transformers"):
        built.append(type(self).__module__ + "." + type(self).__qualname__)
    _module_init(self, *a, **k)
torch.nn.Module.__init__ = _counting_init
from torch_precompile import Precompile
T_PKG = time.perf_counter() - T0
art = Precompile.load(path)
t_load = time.perf_counter() - T0
ids = torch.load(inputs_path).to(device)
with torch.no_grad():
    out = art(ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t_first = time.perf_counter() - T0
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        art(ids, use_cache=False)
    sync()
    per_call_ms = (time.perf_counter() - t) / n * 1e3
ref = torch.load(ref_path).to(device)
ref32 = torch.load(ref32_path).to(device)
diff = (logits.float() - ref.float()).abs()
diff32 = (logits.float() - ref32).abs()
from torch._dynamo.utils import counters
res = {
    "import_torch_s": T_TORCH,
    "import_package_s": T_PKG,
    "load_s": t_load,
    "first_output_s": t_first,
    "per_call_ms": per_call_ms,
    "output_type": type(out).__module__ + "." + type(out).__qualname__,
    "logits_dtype": str(logits.dtype),
    "max_abs_diff_vs_eager_bf16": diff.max().item(),
    "max_diff_rel_to_logit_scale": (diff.max() / ref.float().abs().max()).item(),
    "top1_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    "max_abs_diff_vs_eager_fp32": diff32.max().item(),
    "max_diff_rel_to_logit_scale_vs_eager_fp32": (diff32.max() / ref32.abs().max()).item(),
    "triton_compile_calls": calls["triton.compile"],
    "triton_compile_s": calls["seconds"],
    "triton_compiled_kernels": calls["kernels"],
    "inductor_counters": dict(counters["inductor"]),
    "transformers_modules_constructed": sorted(set(built)),
}
print("RESULT " + json.dumps(res))
"""


def build(name: str, small: bool = False):
    """(model in float32 on the CPU, input ids, config summary); ``small``: 2 layers, d=64."""
    import torch
    import transformers

    torch.manual_seed(0)  # the random weights
    if name == "gpt2":
        size = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512} if small else {}
        cfg = transformers.GPT2Config(**size)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "llama":
        size = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 28}
        size.update(num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
        if small:
            size.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
        cfg = transformers.LlamaConfig(**size)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {name!r}")
    model = model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    summary = {"class": type(model).__name__, "parameters": n_params, "config": cfg.to_diff_dict()}
    return model, ids, summary


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out[0]


def compare(got, ref) -> dict:
    diff = (got.float() - ref.float()).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "max_diff_rel_to_logit_scale": (diff.max() / ref.float().abs().max()).item(),
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def per_call_ms(fn, n: int = 20) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e3


def runtime_env_builtins_added(dynamo_out) -> list[str]:
    """Builtins our _compat adds to Dynamo's runtime env (the torch 2.11 'type' fix)."""
    from torch_precompile._compat import functions

    gco = dynamo_out._handoff.state.capture.graph_capture_output
    plain = gco.get_runtime_env().used_globals
    fixed = functions.runtime_env_with_builtins(gco).used_globals
    return sorted(set(fixed) - set(plain))


def run_model(name: str, tmp: str, device: str, small: bool) -> dict:
    import torch

    from torch_precompile import Precompile

    rep: dict = {"model": name, "dtype": "bfloat16", "batch": BATCH, "seq": SEQ}
    model, ids, rep["summary"] = build(name, small)
    ref32_model = model.to(device)
    ids = ids.to(device)
    kwargs = {"use_cache": False}
    with torch.no_grad():
        ref32 = logits_of(ref32_model(ids, **kwargs)).float().clone()
    model = ref32_model.to(torch.bfloat16)
    stages: dict[str, float] = {}
    with torch.no_grad():
        ref = logits_of(model(ids, **kwargs)).clone()
        rep["eager_per_call_ms"] = per_call_ms(lambda: model(ids, **kwargs))
        rep["eager_bf16_vs_eager_fp32"] = compare(ref, ref32)
        t0 = t = time.perf_counter()
        dyn = Precompile.dynamo(model, (ids,), kwargs)
        stages["dynamo"] = time.perf_counter() - t
        t = time.perf_counter()
        aot = Precompile.aot_autograd(dyn)
        stages["aot_autograd"] = time.perf_counter() - t
        t = time.perf_counter()
        ind = Precompile.inductor(aot)
        stages["inductor"] = time.perf_counter() - t
        t = time.perf_counter()
        art = Precompile.precompile(ind)
        stages["precompile"] = time.perf_counter() - t
        rep["compile_s"] = time.perf_counter() - t0
        rep["stage_s"] = stages
        rep["runtime_env_builtins_added"] = runtime_env_builtins_added(dyn)
        got = logits_of(art(ids, **kwargs)).clone()
        rep["in_process_vs_eager_bf16"] = compare(got, ref)
        rep["in_process_vs_eager_fp32"] = compare(got, ref32)
        rep["in_process_per_call_ms"] = per_call_ms(lambda: art(ids, **kwargs))
    path = os.path.join(tmp, f"{name}.pt")
    t = time.perf_counter()
    Precompile.save(path, art, dyn.bytecode, dyn.guards)
    rep["save_s"] = time.perf_counter() - t
    rep["file_bytes"] = os.path.getsize(path)
    inputs_path = os.path.join(tmp, f"{name}_ids.pt")
    ref_path = os.path.join(tmp, f"{name}_ref.pt")
    ref32_path = os.path.join(tmp, f"{name}_ref32.pt")
    torch.save(ref32.cpu(), ref32_path)
    torch.save(ids.cpu(), inputs_path)
    torch.save(ref.cpu(), ref_path)
    # The model stays on the GPU while the child runs: at most 1 GiB here.

    caches = tempfile.mkdtemp(dir=tmp)
    env = child_env(caches, TORCHINDUCTOR_COMPILE_THREADS="1")
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, path, inputs_path, ref_path, ref32_path, device],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=400,
    )
    rep["fresh_process_wall_s"] = time.perf_counter() - t
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        rep["ok"] = False
        rep["error"] = (proc.stderr or proc.stdout)[-4000:]
        return rep
    fresh = json.loads(line[-1][len("RESULT ") :])
    rep["fresh"] = fresh
    noise = rep["eager_bf16_vs_eager_fp32"]["max_diff_rel_to_logit_scale"]
    rep["tolerance"] = {
        "max_diff_rel_to_logit_scale_vs_eager_bf16": NOISE_FACTOR * noise,
        "max_diff_rel_to_logit_scale_vs_eager_fp32": ACCURACY_FACTOR * noise,
    }
    built = fresh["transformers_modules_constructed"]
    rep["ok"] = (
        not any(n.startswith("transformers.models.") for n in built)
        and fresh["max_diff_rel_to_logit_scale"] <= NOISE_FACTOR * noise
        and fresh["max_diff_rel_to_logit_scale_vs_eager_fp32"] <= ACCURACY_FACTOR * noise
        and rep["in_process_vs_eager_bf16"]["max_diff_rel_to_logit_scale"] <= NOISE_FACTOR * noise
    )
    return rep


def system_info() -> dict:
    import torch
    import transformers

    if not torch.cuda.is_available():
        return {
            "device": "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
    import triton

    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except OSError:
        driver = None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="2-layer configs (a smoke test)")
    opts = parser.parse_args()
    sys.path.insert(0, ROOT)
    report = {"system": system_info(), "small": opts.small, "models": []}
    tmp = tempfile.mkdtemp(prefix="cuda_real_models_")
    for name in opts.models.split(","):
        try:
            rep = run_model(name, tmp, opts.device, opts.small)
        except Exception:
            rep = {"model": name, "ok": False, "error": traceback.format_exc()[-4000:]}
        report["models"].append(rep)
        print(json.dumps(rep, indent=1, default=str), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r.get("ok") for r in report["models"]) else 1


if __name__ == "__main__":
    sys.exit(main())
