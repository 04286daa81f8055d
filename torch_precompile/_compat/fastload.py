"""Fast (lean) load: shipped kernels, no compiler, no Inductor, no Dynamo, no Triton.

A CPU artifact saved in the process that compiled it carries two extra sections:

- the kernels: the shared objects Inductor built for the graph's C++ kernels,
  keyed by a digest of each kernel's source (:mod:`.kernels`), one section each;
- ``fastload``: what is needed to run the compiled graph without PyTorch's
  compiler stack: Inductor's generated Python wrapper (``call(args)``),
  Dynamo's transformed bytecode (which reads the graph inputs off ``self`` and
  rebuilds the outputs), its globals, the signature and the guard state.

Loading writes the shared objects into a private directory, ``dlopen``\\ s them
and executes the wrapper with light stand-ins for the few Inductor names it
imports (:mod:`.wrapper`). No C++ compiler runs, ``TORCHINDUCTOR_CACHE_DIR`` is
not read, and neither ``torch._inductor``'s compiler nor AOTAutograd is
imported. Guards are checked by a plain-Python translation of Dynamo's guard
tree (:mod:`.light_guards`); Dynamo's own guard manager (which imports
``torch._dynamo``) is built only when that check fails or the tree could not be
translated. The saved code was checked at save time to be one of the cases
this runner handles: inference (:mod:`.lean_runtime`: input mutations kept in
the graph, outputs aliasing inputs; ``mode="reduce-overhead"`` recorded by
:mod:`.lean_cudagraphs`) and training (:mod:`.lean_autograd`), on CPU or CUDA,
static or dynamic shapes (Inductor's wrapper reads the sizes off its inputs).
Any other artifact, or any failure here, loads through PyTorch's full path.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import pickle
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import lean_autograd, lean_cudagraphs, lean_runtime, triton_kernels, wrapper
from .bytecode_globals import bytecode_function, global_homes
from .joint import compiled_function_uses_cudagraphs
from .kernels import (
    SHIPPED_KERNELS,
    compiled_graph_sources,
    kernel_file_without_compiling,
    kernel_key,
)
from .light_guard_spec import light_guard_spec
from .light_guards import LightGuards, TieredGuardManager, load_dynamo_guard_manager
from .pickling import dumps_lean, loads_code

log = logging.getLogger("torch_precompile")

FASTLOAD_VERSION = 1
LEAN_DEVICES = ("cpu", "cuda")  # C++ kernels (shared objects), Triton kernels (cubins)


@dataclasses.dataclass
class FastCompiledFunction:
    """A compiled function loaded by the fast path (see the module docstring).

    Shaped like PyTorch's ``AOTCompiledFunction`` where the runtime reads it
    (``_artifacts.guard_manager``, ``.signature``, ``.runtime_env``,
    ``.device_type``; ``fn``), and keeps the bytes it was loaded from so that
    saving it again writes the same sections.
    """

    _artifacts: Any
    fn: Callable[..., Any]
    serialized: bytes
    fastload: bytes
    kernels: Mapping[str, bytes | memoryview]
    _extra_globals: dict[str, Any] | None = None  # the globals imported at load

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.aot_compile import bind_locals

        f_locals = bind_locals(self._artifacts.signature, *args, **kwargs)
        if not self._artifacts.guard_manager.check(f_locals):
            raise RuntimeError("GuardManager check failed")
        return self.fn(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _LeanPlan:
    """How an artifact runs lean: its compiled graphs (forward, and backward for
    training), and the autograd spec (training) or the runtime spec (inference)."""

    graphs: list[Any]
    autograd: lean_autograd.AutogradSpec | None = None
    inference: lean_runtime.InferenceSpec | None = None


def _fast_load_refusal(fn: Any) -> tuple[str | None, _LeanPlan | None]:
    """Why ``fn`` cannot take the fast path (None if it can), and how it runs if it can."""
    artifacts = fn._artifacts
    if artifacts.device_type not in LEAN_DEVICES:
        return f"device {artifacts.device_type}", None
    entry = artifacts.compiled_fn.compiled_fn.serialize()
    if entry.maybe_subclass_meta is not None:
        return "tensor subclass inputs", None
    if any(getattr(w, "needs_post_compile", True) for w in entry.dispatch_wrappers):
        return "duplicated or aliased inputs", None
    if entry.indices_of_inps_to_detach:
        return "inputs to detach", None
    if entry.compiled_bw is not None or entry.num_fw_outs_saved_for_bw:
        reason, autograd = lean_autograd.autograd_refusal(entry)
        if reason is not None:
            return f"training artifact: {reason}", None
        plan = _LeanPlan([entry.compiled_fw.result, entry.compiled_bw.result], autograd=autograd)
    else:
        reason, inference = lean_runtime.inference_refusal(entry)
        if reason is not None:
            return reason, None
        plan = _LeanPlan([entry.compiled_fw.result], inference=inference)
    for graph in plan.graphs:
        reason = _graph_refusal(graph)
        if reason is not None:
            return reason, None
    if plan.autograd is not None and plan.graphs[1].mutated_input_idxs:
        return "training artifact: the backward writes its inputs", None
    return None, plan


def _graph_refusal(graph: Any) -> str | None:
    if set(graph.device_types) - set(LEAN_DEVICES):
        return f"devices {sorted(graph.device_types)}"
    if graph.constants or graph.torchbind_constants:
        return "constants in the compiled graph"
    if graph.partition_maps and any(pm.constant_names for pm in graph.partition_maps):
        return "graph partitions that read constants"
    return wrapper.wrapper_refusal(graph.source_code)


def cpu_kernel_binaries(
    fn: Any, bound_self: Any = None
) -> tuple[bytes, Mapping[str, bytes | memoryview]] | None:
    """The ``fastload`` section and the kernels of a CPU artifact, or None."""
    sections, _ = cpu_fast_sections(fn, bound_self)
    return sections


def cpu_fast_sections(
    fn: Any, bound_self: Any = None
) -> tuple[tuple[bytes, Mapping[str, bytes | memoryview]] | None, str | None]:
    """The ``fastload`` section and the kernels (``{key: shared object}``) of a CPU
    artifact, or None and why not.

    Run at save, in a process where Inductor built (or can build) the kernels:
    each C++ kernel of the wrappers (forward, and backward for training) is
    looked up in Inductor's code cache (a hit right after compiling) and its
    shared object is read back.
    """

    if isinstance(fn, FastCompiledFunction):
        return (fn.fastload, fn.kernels), None
    if not hasattr(fn, "_artifacts"):
        return None, "not a compiled function PyTorch can serialize"
    try:
        reason, plan = _fast_load_refusal(fn)
    except Exception as exc:  # an unexpected PyTorch structure: keep the full path
        reason, plan = f"{type(exc).__name__}: {exc}", None
    if reason is not None or plan is None:
        log.debug("no fast load: %s", reason)
        return None, reason
    from torch._inductor import select_algorithm
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    graphs = plan.graphs
    cudagraphs: dict[str, Any] | None = None
    if compiled_function_uses_cudagraphs(fn):
        if plan.autograd is not None:
            return None, 'mode="reduce-overhead" training (CUDA graphs of forward and backward)'
        # Outputs aliasing inputs (a static cache written in place and returned)
        # are views of the caller's tensors, placed from the inputs the recording
        # received (its copies, or the static inputs themselves): lean_runtime.
        recording, skipped = lean_cudagraphs.cudagraph_spec(graphs[0])
        if recording is None:
            log.info("no CUDA graphs for this artifact: %s", skipped)
        else:
            cudagraphs = dataclasses.asdict(recording)
    sources = [graph.source_code for graph in graphs]
    extern_names = sorted(
        {name for src in sources for name in re.findall(r"\bextern_kernels\.(\w+)", src)}
    )
    for name in extern_names:
        kernel = getattr(select_algorithm.extern_kernels, name, None)
        if kernel is None or kernel is not getattr(torch, name, None):
            return None, f"extern kernel {name}"
    binaries: dict[str, bytes] = {}
    triton_calls: list[tuple[str, list[tuple[str, str, str]]]] = []
    for source in sources:
        for argtypes, kernel_source in wrapper.recorded_kernels(source):
            key = kernel_key(argtypes, kernel_source)
            if key in binaries:
                continue
            kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, kernel_source)
            with open(kernel.__self__.__file__, "rb") as f:
                binaries[key] = f.read()
        triton_calls.append((source, wrapper.recorded_triton_kernels(source)))
    triton_specs: dict[str, dict[str, Any]] = {}
    if any(calls for _, calls in triton_calls):
        found = triton_kernels.triton_sections(triton_calls)
        if isinstance(found, str):
            return None, found
        triton_specs, cubins = found
        binaries.update(cubins)
    env = fn._artifacts.runtime_env
    try:
        used_globals = dumps_lean(dict(env.used_globals))
        signature = pickle.dumps(fn._artifacts.signature, protocol=pickle.HIGHEST_PROTOCOL)
        # A closure's cells hold values the compiled code reads (and guards check);
        # they travel by value, as PyTorch's serialization carries them (a decorated
        # method's undecorated function included).
        closure = dumps_lean([cell.cell_contents for cell in env.closure or ()])
    except Exception as exc:
        return None, f"the closure or globals cannot be pickled ({type(exc).__name__}: {exc})"
    spec = {
        "version": FASTLOAD_VERSION,
        "torch": torch.__version__,
        "wrapper": sources[0],
        "extern_kernels": extern_names,
        "inputs_to_check": [int(i) for i in (graphs[0].inputs_to_check or ())],
        "mutated_inputs": sorted(int(i) for i in graphs[0].mutated_input_idxs),
        "bytecode": dumps_lean(env.bytecode),
        "import_sources": dict(env.import_sources),
        "global_homes": global_homes(env.bytecode, env.import_sources),
        "used_globals": used_globals,
        "used_global_names": sorted(env.used_globals),
        "external_refs": sorted(env.external_refs),
        "argdefs": env.argdefs,
        "closure": closure if env.closure else None,
        "kwdefaults": env.kwdefaults,
        "backend_id": fn._artifacts.backend_id,
        "signature": signature,
        "original_code": dumps_lean(fn._artifacts.original_code),
        "guards_state": fn._artifacts.guards_state,
        "light_guards": light_guard_spec(fn._artifacts.guard_manager, bound_self),
        "hook_guards": True,  # built under hook_guards_enabled (absent: an older file)
        "device_type": fn._artifacts.device_type,
        "triton": triton_specs,  # key -> launch spec of each Triton kernel (cubin in kernels)
        "cudagraphs": cudagraphs,  # mode="reduce-overhead": how to record (None: no CUDA graphs)
    }
    if plan.inference is not None:
        spec["inference"] = {
            "version": lean_runtime.RUNTIME_SPEC_VERSION,
            **dataclasses.asdict(plan.inference),
        }
    autograd = plan.autograd
    if autograd is not None:
        # Training: the backward's wrapper and how autograd runs the pair
        # (absent: an inference artifact).
        spec["backward"] = {
            "version": lean_autograd.AUTOGRAD_SPEC_VERSION,
            "wrapper": sources[1],
            "inputs_to_check": [int(i) for i in (graphs[1].inputs_to_check or ())],
            "autograd": dataclasses.asdict(autograd),
        }
    return (pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL), binaries), None


def load_fast_compiled_function(
    fastload: bytes,
    kernels: Mapping[str, bytes | memoryview],
    serialized: bytes,
    filename: str,
    module_globals: dict[str, Any] | None = None,
) -> FastCompiledFunction:
    """Rebuild a compiled function from its shipped kernels (no compiler, no Triton)."""

    spec = pickle.loads(fastload)
    if spec.get("version") != FASTLOAD_VERSION or spec.get("torch") != torch.__version__:
        raise ValueError("the fast-load section was written by another version")
    guards_c = torch._C._dynamo.guards  # type: ignore[attr-defined]
    data_ptr = str(guards_c._torchinductor_pyobject_tensor_data_ptr)
    graph_call = wrapper.build_graph_call(
        spec["wrapper"],
        spec["extern_kernels"],
        spec["inputs_to_check"],
        kernels,
        data_ptr,
        filename,
        spec.get("triton"),
        spec.get("mutated_inputs", ()),
    )
    backward = spec.get("backward")
    if backward is not None:
        if backward.get("version") != lean_autograd.AUTOGRAD_SPEC_VERSION:
            raise ValueError("the fast-load backward was written by another version")
        bw_call = wrapper.build_graph_call(
            backward["wrapper"],
            spec["extern_kernels"],
            backward["inputs_to_check"],
            kernels,
            data_ptr,
            filename + " (backward)",
            spec.get("triton"),
        )
        graph_call = lean_autograd.make_autograd_call(
            lean_autograd.AutogradSpec(**backward["autograd"]),
            graph_call.call_list,
            bw_call.call_list,
        )
    else:
        call_list = graph_call.call_list
        if spec.get("cudagraphs"):
            recording = lean_cudagraphs.CUDAGraphSpec(**spec["cudagraphs"])
            call_list = lean_cudagraphs.install(
                call_list, graph_call.apply_to_partitions, recording
            )
        graph_call = lean_runtime.make_inference_call(_inference_spec(spec), call_list)
    fn = bytecode_function(spec, graph_call, module_globals)
    original_code = loads_code(spec["original_code"])
    light = None
    if spec.get("light_guards") is not None:
        try:
            light = LightGuards(spec["light_guards"])
        except Exception as exc:
            log.debug("light guards unavailable: %s", exc)
    guard_manager = TieredGuardManager(
        light,
        functools.partial(
            # Built on first need, in the load's context (dict configs as stand-ins).
            contextvars.copy_context().run,
            load_dynamo_guard_manager,
            spec["guards_state"],
            original_code,
            fn.__globals__,
            bool(spec.get("hook_guards")),
        ),
    )
    if light is None:
        guard_manager.full  # noqa: B018 - build now, so that a failure falls back at load
    runtime_env = types.SimpleNamespace(
        bytecode=fn.__code__,
        closure=fn.__closure__,
        import_sources=dict(spec["import_sources"]),
        used_globals=dict.fromkeys(spec.get("used_global_names", ())),
        external_refs=set(spec.get("external_refs", ())),
    )
    artifacts = types.SimpleNamespace(
        backend_id=spec["backend_id"],
        compiled_fn=None,  # nothing of PyTorch's compiled callable is loaded
        guard_manager=guard_manager,
        signature=pickle.loads(spec["signature"]),
        runtime_env=runtime_env,
        device_type=spec.get("device_type", "cpu"),
        original_code=original_code,
    )
    return FastCompiledFunction(artifacts, fn, serialized, fastload, kernels, module_globals)


def _inference_spec(spec: dict[str, Any]) -> lean_runtime.InferenceSpec:
    """The inference runtime spec of a fastload section (absent: a file that had none)."""
    found = dict(spec.get("inference") or {"version": lean_runtime.RUNTIME_SPEC_VERSION})
    if found.pop("version") != lean_runtime.RUNTIME_SPEC_VERSION:
        raise ValueError("the fast-load runtime spec was written by another version")
    return lean_runtime.InferenceSpec(**found)  # pickled as dataclasses.asdict wrote it


def cpu_kernels(fns: Sequence[Any]) -> dict[str, bytes]:
    """The shipped kernels of CPU compiled functions (all variants, forward and backward).

    Each C++ kernel of each wrapper is looked for among the shipped kernels
    loaded in this process, then in Inductor's code cache (no compile); a kernel
    found in neither is left out (loading then compiles it).
    """
    binaries: dict[str, bytes] = {}
    missing = 0
    for fn in fns:
        if isinstance(fn, FastCompiledFunction):
            binaries.update((k, bytes(v)) for k, v in fn.kernels.items())
            continue
        try:
            sources = compiled_graph_sources(fn)
        except Exception as exc:  # an unexpected PyTorch structure: ship nothing for it
            log.debug("no shipped kernels for a compiled function: %s", exc)
            continue
        for source in sources:
            try:
                calls = wrapper.recorded_kernels(source)
            except Exception as exc:
                log.debug("cannot list the kernels of a wrapper: %s", exc)
                continue
            for argtypes, kernel_source in calls:
                key = kernel_key(argtypes, kernel_source)
                if key in binaries:
                    continue
                shipped = SHIPPED_KERNELS.get(key)
                try:
                    if shipped is not None:
                        path = shipped.__self__.__file__
                    else:
                        path = kernel_file_without_compiling(argtypes, kernel_source)
                    if path is not None:
                        with open(path, "rb") as f:
                            binaries[key] = f.read()
                        continue
                except Exception as exc:
                    log.debug("kernel %s not found: %s", key[:12], exc)
                missing += 1
    if missing:
        log.debug("%d kernels not shipped: loading will compile them", missing)
    return binaries
