"""Probe the device machine's torch: private API signatures, sources, and a smoke run.

Writes $OUT/probe.json, $OUT/torch_src.tar.gz (compiler sources) and prints tracebacks.
"""

import importlib
import inspect
import json
import os
import sys
import tarfile

import torch

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)

rep = {
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": sys.version,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
}
try:
    import triton

    rep["triton"] = triton.__version__
except Exception as e:
    rep["triton"] = repr(e)


def sig(mod, name):
    try:
        m = importlib.import_module(mod)
        obj = m
        for part in name.split("."):
            obj = getattr(obj, part)
        try:
            return str(inspect.signature(obj))
        except Exception:
            return "exists:" + type(obj).__name__
    except Exception as e:
        return "MISSING " + repr(e)[:200]


checks = [
    ("torch._dynamo.convert_frame", "fullgraph_capture"),
    ("torch._dynamo.convert_frame", "get_traced_fn"),
    ("torch._dynamo.convert_frame", "_get_signature"),
    ("torch._dynamo.convert_frame", "get_compile_id"),
    ("torch._dynamo.convert_frame", "GraphCaptureOutput.build_guards"),
    ("torch._dynamo.convert_frame", "GraphCaptureOutput.get_runtime_env"),
    ("torch._dynamo.graph_utils", "_graph_device_type"),
    ("torch._dynamo.eval_frame", "set_enable_dynamic"),
    ("torch._dynamo.utils", "get_metrics_context"),
    ("torch._dynamo.utils", "dynamo_timed"),
    ("torch._dynamo.utils", "_disable_saved_tensors_hooks_during_tracing"),
    ("torch._dynamo.variables.torch_function", "torch_function_mode_stack_state_mgr"),
    ("torch._functorch.aot_autograd", "aot_export_joint_with_descriptors"),
    ("torch._functorch.aot_autograd", "aot_compile_joint_with_descriptors"),
    ("torch._functorch.aot_autograd", "preserve_rng_state"),
    ("torch._functorch._aot_autograd.runtime_wrappers", "SerializableCompiledFunction"),
    ("torch._dynamo.aot_compile_types", "BundledAOTAutogradSerializableCallable"),
    ("torch._dynamo.aot_compile", "AOTCompiledFunction"),
    ("torch._dynamo.aot_compile", "AOTCompiledFunction.serialize"),
    ("torch._dynamo.aot_compile", "AOTCompiledFunction.deserialize"),
    ("torch._dynamo.aot_compile", "CompileArtifacts"),
    ("torch._dynamo.package", "SourceInfo"),
    ("torch._dynamo.hooks", "Hooks"),
    ("torch._dynamo.guards", "GuardsStatePickler"),
    ("torch._dynamo.guards", "GuardsStatePickler._unpickle_module"),
    ("torch._inductor.compile_fx", "compile_fx_forward"),
    ("torch._inductor.compile_fx", "compile_fx_backward"),
    ("torch._inductor.compile_fx", "create_compiler_config_extra"),
    ("torch._inductor.compile_fx", "get_num_model_outputs"),
    ("torch._inductor.compile_fx", "run_pre_grad_passes"),
    ("torch._inductor.compile_fx", "partition_fn"),
    ("torch._inductor", "list_mode_options"),
    ("torch._inductor.decomposition", "select_decomp_table"),
    ("torch._inductor.triton_bundler", "TritonBundler"),
    ("torch.compiler", "save_cache_artifacts"),
    ("torch.compiler", "load_cache_artifacts"),
    ("torch.compiler", "load_compiled_function"),
    ("torch._decomp.decompositions_for_rng", "PhiloxStateTracker"),
    ("torch._inductor", "aoti_compile_and_package"),
    ("torch._inductor", "aoti_load_package"),
]
rep["sigs"] = {f"{m}.{n}": sig(m, n) for m, n in checks}
fc = importlib.import_module("torch._functorch.config")

rep["functorch_config"] = {
    k: getattr(fc, k, "MISSING")
    for k in [
        "strict_autograd_cache",
        "bypass_autograd_cache_key",
        "bundled_autograd_cache",
        "force_non_lazy_backward_lowering",
        "force_autograd_cache",
        "unlift_effect_tokens",
    ]
}
try:
    import dataclasses

    from torch._dynamo.aot_compile import CompileArtifacts

    rep["CompileArtifacts_fields"] = [f.name for f in dataclasses.fields(CompileArtifacts)]
except Exception as e:
    rep["CompileArtifacts_fields"] = repr(e)
print(json.dumps(rep, indent=1))
with open(f"{OUT}/probe.json", "w") as out_file:
    json.dump(rep, out_file, indent=1)

# sources of the compiler, to read locally
root = os.path.dirname(torch.__file__)
with tarfile.open(f"{OUT}/torch_src.tar.gz", "w:gz") as tar:
    for sub in [
        "_dynamo",
        "_functorch",
        "_inductor",
        "compiler",
        "_guards.py",
        "_subclasses",
        "fx/experimental/symbolic_shapes.py",
        "_export/__init__.py",
    ]:
        p = os.path.join(root, sub)
        if os.path.isfile(p):
            tar.add(p, arcname=sub)
            continue
        for dp, _, fn in os.walk(p):
            for f in fn:
                if f.endswith(".py"):
                    full = os.path.join(dp, f)
                    tar.add(full, arcname=os.path.relpath(full, root))
print("tar size", os.path.getsize(f"{OUT}/torch_src.tar.gz"))
