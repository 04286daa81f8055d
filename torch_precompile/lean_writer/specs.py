"""What the lean runtime can run, decided at save from PyTorch's compiled objects.

Each function reads one part of a compiled function (AOTAutograd's runtime
metadata, a tensor subclass plan, Inductor's wrapper and CUDA-graph info) and
answers with the spec the matching ``lean/`` module runs, or why it cannot run
it (then the artifact loads on PyTorch's full path). The specs are records of the
lean format's schema (``lean/schema.py``); ``lean_sections`` writes them into the
file.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..lean.autograd import RNG_IN_WRAPPER
from ..lean.guard_types import named_class
from ..lean.pickling import dumps as stable_dumps
from ..lean.schema import AutogradSpec, CUDAGraphSpec, InferenceSpec, SubclassSpec
from ..lean.wrapper import (
    main_code,
    strip_wrapper_imports,
    wrapper_inductor_imports,
)


def mutation_refusal(meta: Any) -> str | None:
    """Why AOTAutograd's mutations of the graph inputs need its own runtime (None
    when all of them happen inside the compiled graph)."""
    from torch._functorch._aot_autograd.schemas import MutationType

    for info in meta.input_info:
        if info.mutation_type == MutationType.MUTATED_OUT_GRAPH:
            return (
                "the graph mutates an input outside the compiled graph "
                "(its metadata, or an input that requires grad)"
            )
        if info.mutates_storage_metadata or info.mutation_inductor_storage_resize:
            return "the graph resizes or sets an input's storage"
    return None


def inference_refusal(entry: Any) -> tuple[str | None, InferenceSpec | None]:
    """Why AOTAutograd's inference entry needs its own runtime (None if this
    module's can run it), and the spec when it can."""
    from torch._functorch._aot_autograd.schemas import OutputType

    meta = entry.runtime_metadata
    reason = mutation_refusal(meta)
    if reason is not None:
        return reason, None
    aliases: list[tuple[int, bool, bool] | None] = []
    for info in meta.output_info:
        kind = info.output_type
        if kind in (OutputType.non_alias, OutputType.unsafe_view_alias):
            aliases.append(None)
        elif kind in (OutputType.alias_of_input, OutputType.is_input):
            aliases.append((int(info.base_idx), kind == OutputType.is_input, info.requires_grad))
        else:
            return f"an output is {kind.name}", None
    if meta.num_intermediate_bases or meta.tokens:
        return "intermediate bases or effect tokens", None
    if getattr(meta, "grad_enabled_mutation", None) is not None:
        return "the graph changes the grad mode", None
    spec = InferenceSpec(
        mutated_seen_by_autograd=tuple(
            int(i) for i in meta.mutated_graph_handled_indices_seen_by_autograd
        ),
        aliases=tuple(aliases) if any(a is not None for a in aliases) else (),
        dynamic_dims=tuple(
            None if info.dynamic_dims is None else tuple(sorted(info.dynamic_dims))
            for info in meta.output_info
        )
        if getattr(meta, "dynamic_outputs", False)
        else (),
    )
    return None, spec


def autograd_refusal(entry: Any) -> tuple[str | None, AutogradSpec | None]:
    """Why AOTAutograd's training entry cannot run as a plain ``autograd.Function``
    (None if it can), and the spec when it can."""
    from torch._functorch._aot_autograd.schemas import OutputType

    if entry.compiled_bw is None:
        return "the backward is compiled lazily", None
    if getattr(entry.compiled_bw, "backward_state_indices", None):
        return "a BackwardState input (compiled autograd)", None
    meta = entry.runtime_metadata
    reason = mutation_refusal(meta)
    if reason is not None:
        return reason, None
    allowed = {OutputType.non_alias, OutputType.unsafe_view_alias}
    for info in meta.output_info:
        if info.output_type not in allowed:
            return f"an output is {info.output_type.name}", None
        if info.dynamic_dims:
            return "an output has dynamic dimensions", None
    if meta.num_intermediate_bases or meta.tokens or meta.num_backward_tokens:
        return "intermediate bases or effect tokens", None
    if meta.num_graphsafe_rng_states or meta.is_rng_op_functionalized:
        return "RNG state threaded through the graph", None
    if meta.grad_enabled_mutation is not None:
        return "the graph changes the grad mode", None
    if meta.dynamic_saved_tensors_idxs:
        return "dynamic saved tensors", None
    if meta.indices_of_inputs_that_requires_grad_with_mutations_in_bw:
        return "the backward mutates an input", None
    for graph in (entry.compiled_fw.result, entry.compiled_bw.result):
        if RNG_IN_WRAPPER.search(graph.source_code.split('\nif __name__ == "__main__":')[0]):
            return "random ops (e.g. dropout) in the compiled graph", None
    n = meta.num_forward_returns
    if n != meta.num_outputs:
        return "forward returns other than the user's outputs", None
    tangent_outputs = []
    for i, info in enumerate(meta.output_info):
        # torch 2.11 has no requires_grad_for_backward (its tangents follow requires_grad).
        needs_grad = getattr(info, "requires_grad_for_backward", info.requires_grad)
        if issubclass(info.raw_type, torch.Tensor) and needs_grad:
            tangent_outputs.append(i)
    layouts: list[Any] = []
    tangent_metas = list(meta.subclass_tangent_meta)
    if len(tangent_metas) != len(tangent_outputs):
        return "tangents do not match the outputs that need gradients", None
    for tm in tangent_metas:
        fmt = tm.memory_format
        if fmt.memory_format is not None:
            layouts.append(fmt.memory_format)
        else:
            size, stride = fmt.size, fmt.stride
            if not all(isinstance(s, int) for s in (*size, *stride)):
                return "a tangent of symbolic shape", None
            layouts.append((tuple(int(s) for s in size), tuple(int(s) for s in stride)))
    spec = AutogradSpec(
        num_forward_returns=n,
        saved_vc_check=meta.tensors_saved_for_backwards_with_vc_check_slice,
        saved_no_vc_check=meta.tensors_saved_for_backwards_no_vc_check_slice,
        saved_symints=meta.symints_saved_for_backwards_slice,
        unsafe_view_outputs=tuple(int(i) for i in meta.unsafe_view_out_indices),
        non_differentiable=tuple(
            i for i, info in enumerate(meta.output_info) if not info.requires_grad
        ),
        tangent_outputs=tuple(tangent_outputs),
        tangent_layouts=tuple(layouts),
        donated_buffers=bool(meta.bw_donated_idxs),
        nondeterministic=meta.deterministic is False,
        mutated_seen_by_autograd=tuple(
            int(i) for i in meta.mutated_graph_handled_indices_seen_by_autograd
        ),
        # torch 2.11 saves no opaque objects (and has no such slice).
        saved_opaque=getattr(meta, "opaque_objects_saved_for_backwards_slice", slice(0, 0)),
    )
    return None, spec


def _static(values: Any) -> bool:
    return all(type(v) is int for v in values)


def _rebuilt(metas: Any, opaque: type, what: str) -> tuple[str | None, tuple[tuple[Any, ...], ...]]:
    """Per meta (AOTAutograd's ``PlainTensorMeta``/``SubclassCreationMeta`` of an output
    or a gradient): ``(index,)`` or how the subclass is rebuilt (see SubclassSpec)."""
    from torch._functorch._aot_autograd.schemas import PlainTensorMeta

    rebuilt: list[tuple[Any, ...]] = []
    for m in metas:
        if isinstance(m, PlainTensorMeta):
            rebuilt.append((int(m.unwrapped_idx),))
            continue
        cls = m.original_subclass_type
        if cls is None or named_class(cls.__module__, cls.__qualname__) is not cls:
            return f"a tensor subclass {what} whose class cannot be found by name", ()
        if not (_static(m.outer_size) and _static(m.outer_stride)):
            return f"a tensor subclass {what} with dynamic shapes", ()
        if not all(isinstance(a, (PlainTensorMeta, opaque)) for a in m.attrs.values()):
            return f"a nested tensor subclass {what}", ()
        try:
            flat_meta = stable_dumps(m.meta)
        except Exception as exc:
            return f"a tensor subclass {what}'s metadata cannot be pickled ({exc})", ()
        rebuilt.append(
            (
                int(m.flat_tensor_start_idx),
                cls.__module__,
                cls.__qualname__,
                tuple(m.attrs),
                flat_meta,
                tuple(m.outer_size),
                tuple(m.outer_stride),
            )
        )
    return None, tuple(rebuilt)


def subclass_refusal(
    entry: Any, graphs: list[Any], training: bool = False
) -> tuple[str | None, SubclassSpec | None]:
    """Why AOTAutograd's subclass handling of ``entry`` needs its own runtime (None
    if this module's can run it), and the spec when it can. ``graphs``: the
    compiled forward (and backward), for their constants."""
    from torch._functorch._aot_autograd import schemas
    from torch._functorch._aot_autograd.schemas import PlainTensorMeta, SubclassCreationMeta
    from torch.distributed.device_mesh import DeviceMesh

    # An opaque attribute (the mesh, torch 2.13); torch 2.11 flattens to tensors only.
    opaque = getattr(schemas, "OpaqueMeta", PlainTensorMeta)

    meta = entry.runtime_metadata
    inputs: list[tuple[str, ...] | None] = []
    for m in meta.subclass_inp_meta:
        if isinstance(m, PlainTensorMeta) or not isinstance(m, SubclassCreationMeta):
            inputs.append(None)  # a plain tensor, or a Python value passed as it is
            continue
        if not (_static(m.outer_size) and _static(m.outer_stride)):
            return "a tensor subclass input with dynamic shapes", None
        if not all(isinstance(a, (PlainTensorMeta, opaque)) for a in m.attrs.values()):
            return "a nested tensor subclass input", None
        inputs.append(tuple(m.attrs))
    out_metas = meta.subclass_fw_graph_out_meta
    reason, outputs = _rebuilt(out_metas, opaque, "output")
    if reason is not None:
        return reason, None
    extra: dict[str, Any] = {}
    if training:
        if any(isinstance(m, SubclassCreationMeta) for m in meta.subclass_tangent_meta):
            return "a tensor subclass tangent (a DTensor output that needs a gradient)", None
        grad_metas = entry.maybe_subclass_meta.grad_input_metas
        if grad_metas is None:
            return "no gradient layout for the tensor subclass inputs", None
        reason, extra["grad_inputs"] = _rebuilt(grad_metas, opaque, "gradient")
        if reason is not None:
            return reason, None
        extra["user_flat_outputs"] = sum(
            1 if isinstance(m, PlainTensorMeta) else int(m.arg_count) for m in out_metas
        )
    constants: dict[str, Any] = {}
    for graph in graphs:
        constants.update(graph.torchbind_constants or {})
    meshes = tuple(
        sorted(k for k, v in constants.items() if isinstance(getattr(v, "real_obj", v), DeviceMesh))
    )
    if set(constants) - set(meshes):
        return "constants in the compiled graph", None
    return None, SubclassSpec(tuple(inputs), outputs, meshes, **extra)


def cudagraph_spec(graph: Any) -> tuple[CUDAGraphSpec | None, str | None]:
    """The recording spec of Inductor's compiled graph (compiled under
    ``triton.cudagraphs``), or None and why Inductor runs it without CUDA graphs."""
    info = getattr(graph, "cudagraph_info", None)
    if info is None:
        return None, "the compiled graph carries no CUDA-graph information"
    if info.cudagraph_fail_reasons:
        return None, f"Inductor skips CUDA graphs: {'; '.join(info.cudagraph_fail_reasons)}"
    if getattr(graph, "kernel_free_cudagraph", False):
        # torch 2.14+: a graph that launches no kernel is not recorded by the trees either.
        return None, "the graph launches no kernel (Inductor records no CUDA graph for it)"
    devices = sorted(graph.device_idxs)
    if len(devices) != 1:
        return None, f"CUDA graphs over devices {devices}"
    static = tuple(int(i) for i in graph.fx_kwargs.get("static_input_idxs") or ())
    partitions = None
    if graph.partition_maps is not None:
        if not graph.partition_maps:
            return None, "no graph partition to record"
        partitions = tuple(
            tuple(i for i, g in enumerate(pm.input_index_mapping) if g is not None and g in static)
            for pm in graph.partition_maps
        )
    return CUDAGraphSpec(static, int(devices[0]), partitions), None


def wrapper_refusal(source: str) -> str | None:
    """Why Inductor's wrapper cannot run with the lean path's stand-ins (None if it can)."""

    bad = wrapper_inductor_imports(source)
    if bad:
        return f"the wrapper imports {bad[0]!r}"
    main = main_code(strip_wrapper_imports(source))
    for name in ("run_intermediate_hooks", "maybe_profile", "start_graph", "end_graph"):
        if main.count(name) > 1:
            return f"the wrapper calls {name}"
    if re.search(r"\b(triton|tl)\.", main):
        return "the wrapper uses triton outside its kernels"
    methods = set(re.findall(r"\basync_compile\.(\w+)", main))
    known = {"cpp_pybinding", "wait", "triton"}
    if methods - known:
        return f"the wrapper compiles {sorted(methods - known)} kernels"
    return None


def recorded_kernels(source: str) -> list[tuple[list[str], str]]:
    """The (argtypes, source) of each ``async_compile.cpp_pybinding`` call of the wrapper."""
    return recorded_calls(source)[0]


def recorded_calls(source: str) -> tuple[list[tuple[list[str], str]], list[tuple[str, str, str]]]:
    """The kernels the wrapper asks for, from one run of its module body: the
    (argtypes, source) of each ``async_compile.cpp_pybinding`` call and the
    (name, source, device) of each ``async_compile.triton`` call."""
    calls: list[tuple[list[str], str]] = []
    triton_calls: list[tuple[str, str, str]] = []

    class Recorder:
        def __call__(self) -> Any:
            return self

        def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Any:
            calls.append((list(argtypes), source_code))
            return None

        def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> Any:
            triton_calls.append((kernel_name, source_code, device_str))
            return None

        def wait(self, scope: Any) -> None:
            pass

    namespace: dict[str, Any] = {
        "run_intermediate_hooks": None,
        "maybe_profile": None,
        "align": None,
        "AsyncCompile": Recorder(),
        "extern_kernels": None,
        "start_graph": None,
        "end_graph": None,
        "assert_tensor_metadata": None,
        "__name__": "torch_precompile_wrapper_probe",
    }
    code = compile(strip_wrapper_imports(source), "<inductor wrapper>", "exec")
    exec(code, namespace)
    return calls, triton_calls
