"""Lean load, at save: what an artifact needs to run without the compiler.

Reads PyTorch's compiled function (AOTAutograd's cache entry, Inductor's
compiled graphs, Dynamo's runtime environment and guards) and writes the
sections that :mod:`.lean` (``load_lean_compiled_function``) runs at load.

An artifact carries two extra sections:

- the kernels: the shared objects Inductor built for the graph's C++ kernels,
  keyed by a digest of each kernel's source (:mod:`.lean.kernels`), one section
  each; the artifact owns them (taken when Inductor returned them, or read from
  the file it was loaded from);
- ``lean``: what is needed to run the compiled graph without PyTorch's
  compiler stack: Inductor's generated Python wrapper (``call(args)``),
  Dynamo's transformed bytecode (which reads the graph inputs off ``self`` and
  rebuilds the outputs), its globals, the signature and the guard state.

How loading runs them is :mod:`.lean.compiled_function`'s docstring. A variant that none of the
lean runtime's cases covers gets no ``lean`` section (the reason is recorded)
and loads through PyTorch's full path.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .._compat.codecache import (
    built_kernel_binary,
    compiled_graph_sources,
    kernel_file_without_compiling,
)
from .._compat.joint import compiled_function_uses_cudagraphs
from ..lean import (
    AutogradSpec,
    BackwardSection,
    CompiledPython,
    CUDAGraphSpec,
    InferenceSpec,
    LeanCompiledFunction,
    LeanSection,
    SubclassSpec,
    TritonLaunch,
    kernel_key,
    pycode,
)
from ..lean.bytecode_globals import global_homes
from ..lean.guard_schema import GuardTree
from ..lean.guards import GUARDS_FILENAME, LeanGuards, prepared
from ..lean.pickling import dumps as stable_dumps
from ..lean.pickling import dumps_lean
from ..lean.wrapper import strip_wrapper_imports
from .specs import (
    autograd_refusal,
    cudagraph_spec,
    inference_refusal,
    recorded_calls,
    recorded_kernels,
    subclass_refusal,
    wrapper_refusal,
)
from .triton_cubins import kept_cubins, triton_sections

log = logging.getLogger("torch_precompile")

LEAN_DEVICES = ("cpu", "cuda")  # C++ kernels (shared objects), Triton kernels (cubins)


@dataclasses.dataclass(frozen=True)
class _LeanPlan:
    """How an artifact runs lean: its compiled graphs (forward, and backward for
    training), and the autograd spec (training) or the runtime spec (inference)."""

    graphs: list[Any]
    autograd: AutogradSpec | None = None
    inference: InferenceSpec | None = None
    subclasses: SubclassSpec | None = None  # tensor subclass (DTensor) inputs or outputs


def _lean_refusal(fn: Any) -> tuple[str | None, _LeanPlan | None]:
    """Why ``fn`` cannot take the lean path (None if it can), and how it runs if it can."""
    artifacts = fn._artifacts
    if artifacts.device_type not in LEAN_DEVICES:
        return f"device {artifacts.device_type}", None
    entry = artifacts.compiled_fn.compiled_fn.serialize()
    if any(getattr(w, "needs_post_compile", True) for w in entry.dispatch_wrappers):
        return "duplicated or aliased inputs", None
    if entry.indices_of_inps_to_detach:
        return "inputs to detach", None
    if entry.compiled_bw is not None or entry.num_fw_outs_saved_for_bw:
        reason, autograd = autograd_refusal(entry)
        if reason is not None:
            return f"training artifact: {reason}", None
        plan = _LeanPlan([entry.compiled_fw.result, entry.compiled_bw.result], autograd=autograd)
    else:
        reason, inference = inference_refusal(entry)
        if reason is not None:
            return reason, None
        plan = _LeanPlan([entry.compiled_fw.result], inference=inference)
    if entry.maybe_subclass_meta is not None:
        if plan.inference is not None and plan.inference.aliases:
            return "tensor subclass (DTensor) inputs and outputs aliasing inputs", None
        training = plan.autograd is not None
        reason, subclasses = subclass_refusal(entry, plan.graphs, training)
        if reason is not None:
            return ("training artifact: " if training else "") + reason, None
        plan = dataclasses.replace(plan, subclasses=subclasses)
    for graph in plan.graphs:
        reason = _graph_refusal(graph, plan.subclasses)
        if reason is not None:
            return reason, None
    if plan.autograd is not None and plan.graphs[1].mutated_input_idxs:
        return "training artifact: the backward writes its inputs", None
    return None, plan


def _graph_refusal(graph: Any, subclasses: SubclassSpec | None = None) -> str | None:
    if set(graph.device_types) - set(LEAN_DEVICES):
        return f"devices {sorted(graph.device_types)}"
    meshes = set(subclasses.mesh_constants) if subclasses is not None else set()
    if graph.constants or set(graph.torchbind_constants or {}) - meshes:
        return "constants in the compiled graph"
    if graph.partition_maps and any(pm.constant_names for pm in graph.partition_maps):
        return "graph partitions that read constants"
    return wrapper_refusal(graph.source_code)


Kernels = Mapping[str, bytes | memoryview]  # kernel key -> shared object (or cubin)


def kept_kernels(sources: Iterable[str]) -> dict[str, bytes]:
    """The shared object of each C++ kernel and the cubin of each Triton kernel of
    Inductor's wrappers ``sources``, by key, read as Inductor's compile returns: the
    artifact owns them from then on, so a save never looks in Inductor's or Triton's
    cache directory, which may be gone by then.

    Each C++ kernel is a hit in Inductor's code cache right after the compile (one
    that is not is built now, while the compiler is known to be there); the Triton
    kernels are tuned now where they still are (:func:`.triton_cubins.kept_cubins`).
    A kernel that cannot be read is left out (loading then compiles it): a compile
    never fails over them.
    """
    binaries: dict[str, bytes] = {}
    wrappers: list[tuple[str, list[tuple[str, str, str]]]] = []
    for source in sources:
        try:
            cpp_calls, triton_calls = recorded_calls(source)  # runs the wrapper's body once
        except Exception as exc:  # an unexpected wrapper: keep nothing of it
            log.debug("cannot list the kernels of a wrapper: %s", exc)
            continue
        wrappers.append((source, triton_calls))
        for argtypes, kernel_source in cpp_calls:
            key = kernel_key(argtypes, kernel_source)
            if key in binaries:
                continue
            try:
                binaries[key] = built_kernel_binary(argtypes, kernel_source)
            except Exception as exc:
                log.debug("kernel %s not kept: %s", key[:12], exc)
    if any(calls for _, calls in wrappers):
        try:
            binaries.update(kept_cubins(wrappers))
        except Exception as exc:  # an unexpected wrapper: the save reads them, as before
            log.debug("Triton cubins not kept: %s", exc)
    return binaries


def _wrapper_kernels(sources: Iterable[str]) -> Iterator[tuple[str, Any, str]]:
    """``(key, argtypes, source)`` of each C++ kernel call of Inductor's wrappers
    ``sources``; a wrapper whose calls cannot be listed is skipped (nothing shipped)."""
    for source in sources:
        try:
            calls = recorded_kernels(source)
        except Exception as exc:  # an unexpected wrapper: ship nothing for it
            log.debug("cannot list the kernels of a wrapper: %s", exc)
            continue
        for argtypes, kernel_source in calls:
            yield kernel_key(argtypes, kernel_source), argtypes, kernel_source


def _kernel_binary(owned: Kernels, argtypes: list[str], source: str) -> bytes:
    """A C++ kernel's shared object: the artifact's own; one it does not own (an
    artifact loaded from a file without it, its kernels compiled at load) from
    Inductor's code cache, built if need be."""
    key = kernel_key(argtypes, source)
    if key in owned:
        return bytes(owned[key])
    log.debug("kernel %s is not the artifact's own: reading Inductor's cache", key[:12])
    return built_kernel_binary(argtypes, source)


def lean_sections(
    fn: Any, owned: Kernels | None = None, lean_guards: GuardTree | None = None
) -> tuple[tuple[bytes, Kernels] | None, str | None]:
    """The ``lean`` section and the kernels (``{key: shared object}``) of a CPU
    artifact, or None and why not.

    ``owned`` are the artifact's kernels (:func:`kept_kernels` at
    compile, or the file's at load): each C++ kernel of the wrappers (forward,
    and backward for training) is taken from them. ``lean_guards`` is the spec
    of its guard tree read at precompile (:func:`.guard_manager.build_guard_manager`);
    None: none (a function of a lean load gives back the section it was read from).
    """

    if isinstance(fn, LeanCompiledFunction):
        return (fn.lean_section, fn.kernels), None
    if not hasattr(fn, "_artifacts"):
        return None, "not a compiled function PyTorch can serialize"
    try:
        reason, plan = _lean_refusal(fn)
    except Exception as exc:  # an unexpected PyTorch structure: keep the full path
        reason, plan = f"{type(exc).__name__}: {exc}", None
    if reason is not None or plan is None:
        log.debug("no lean load: %s", reason)
        return None, reason
    from torch._inductor import select_algorithm

    graphs = plan.graphs
    cudagraphs: CUDAGraphSpec | None = None
    if compiled_function_uses_cudagraphs(fn):
        if plan.autograd is not None:
            return None, 'mode="reduce-overhead" training (CUDA graphs of forward and backward)'
        # Outputs aliasing inputs (a static cache written in place and returned)
        # are views of the caller's tensors, placed from the inputs the recording
        # received (its copies, or the static inputs themselves): lean.inference.
        recording, skipped = cudagraph_spec(graphs[0])
        if recording is None:
            log.info("no CUDA graphs for this artifact: %s", skipped)
        else:
            cudagraphs = recording
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
        cpp_calls, triton_found = recorded_calls(source)  # runs the wrapper's body once
        for argtypes, kernel_source in cpp_calls:
            key = kernel_key(argtypes, kernel_source)
            if key in binaries:
                continue
            binaries[key] = _kernel_binary(owned or {}, argtypes, kernel_source)
        triton_calls.append((source, triton_found))
    triton_specs: dict[str, TritonLaunch] = {}
    if any(calls for _, calls in triton_calls):
        found = triton_sections(triton_calls, owned)
        if isinstance(found, str):
            return None, found
        triton_specs, cubins = found
        binaries.update(cubins)
    env = fn._artifacts.runtime_env
    try:
        used_globals = dumps_lean(dict(env.used_globals))
        signature = stable_dumps(fn._artifacts.signature)
        # A closure's cells hold values the compiled code reads (and guards check);
        # they travel by value, as PyTorch's serialization carries them (a decorated
        # method's undecorated function included).
        closure = dumps_lean([cell.cell_contents for cell in env.closure or ()])
    except Exception as exc:
        return None, f"the closure or globals cannot be pickled ({type(exc).__name__}: {exc})"
    autograd = plan.autograd
    section = LeanSection(
        wrapper=sources[0],
        extern_kernels=extern_names,
        inputs_to_check=[int(i) for i in (graphs[0].inputs_to_check or ())],
        mutated_inputs=sorted(int(i) for i in graphs[0].mutated_input_idxs),
        bytecode=dumps_lean(env.bytecode),
        import_sources=dict(env.import_sources),
        global_homes=global_homes(env.bytecode, env.import_sources),
        used_globals=used_globals,
        used_global_names=sorted(env.used_globals),
        external_refs=sorted(env.external_refs),
        argdefs=env.argdefs,
        closure=closure if env.closure else None,
        kwdefaults=env.kwdefaults,
        backend_id=fn._artifacts.backend_id,
        signature=signature,
        original_code=dumps_lean(fn._artifacts.original_code),
        guards_state=fn._artifacts.guards_state,
        # Pickled apart: a load whose Python takes the saved guard function (below)
        # never unpickles the tree (a 24-layer generator's five: 25 ms on a CPU core).
        lean_guards=lean_guards,
        hook_guards=True,  # built under hook_guards_enabled
        device_type=fn._artifacts.device_type,
        triton=triton_specs,
        cudagraphs=cudagraphs,
        pycode=_compiled_python(sources, lean_guards),
        inference=plan.inference,
        subclasses=plan.subclasses,
        # Training: the backward's wrapper and how autograd runs the pair.
        backward=None
        if autograd is None
        else BackwardSection(
            sources[1], tuple(int(i) for i in (graphs[1].inputs_to_check or ())), autograd
        ),
    )
    return (stable_dumps(section.write()), binaries), None


def _compiled_python(sources: list[str], lean_guards: GuardTree | None) -> CompiledPython:
    """What the load would compile (the wrappers, the guard function), compiled here
    (:mod:`..lean.pycode`): a load on the same Python unmarshals it instead."""
    wrappers = [pycode.compiled(strip_wrapper_imports(s), "<wrapper>") for s in sources]
    guards = emitted = None
    if lean_guards is not None:
        try:
            checked = LeanGuards(lean_guards)
        except Exception as exc:  # the load will say so too, and use Dynamo's guards
            log.debug("no compiled lean guards: %s", exc)
        else:
            guards = pycode.compiled(checked.source, GUARDS_FILENAME)
            emitted = prepared(checked)  # the load skips writing the check
    return CompiledPython(wrappers[0], wrappers[1] if len(wrappers) > 1 else None, guards, emitted)


def cpp_kernels(fns: Sequence[tuple[Any, Kernels]]) -> dict[str, bytes]:
    """The shipped kernels of CPU compiled functions (all variants, forward and
    backward), each given with the kernels its artifact owns.

    Each C++ kernel of each wrapper is taken from its artifact's own, else looked
    for in Inductor's code cache (no compile); a kernel found in neither is left
    out (loading then compiles it).
    """
    binaries: dict[str, bytes] = {}
    missing = 0
    for fn, owned in fns:
        if isinstance(fn, LeanCompiledFunction):
            binaries.update((k, bytes(v)) for k, v in fn.kernels.items())
            continue
        try:
            sources = compiled_graph_sources(fn)
        except Exception as exc:  # an unexpected PyTorch structure: ship nothing for it
            log.debug("no shipped kernels for a compiled function: %s", exc)
            continue
        for key, argtypes, kernel_source in _wrapper_kernels(sources):
            if key in binaries:
                continue
            if key in owned:
                binaries[key] = bytes(owned[key])
                continue
            try:
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
