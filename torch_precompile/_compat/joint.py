"""AOTAutograd and Inductor: export the joint graph once, then partition and compile it."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .capture import Capture, size_oblivious_context
from .graph_copy import copy_graph_module, joint_for_one_compile
from .inductor_fixes import (
    bounds_checks_after_their_index,
    full_width_byte_loads,
    resolve_overload_packets,
    stride_order_without_guards,
)


def default_decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def computed_once(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a buffer of its own in the code Inductor generates, rather than computed
    again inside every kernel that reads it (Inductor's ``force_stride_order`` prim at
    ``t``'s own strides; in eager, and where ``t`` is a buffer already, ``t`` itself)."""
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order(t, t.stride())


@contextlib.contextmanager
def _tracing(capture: Capture) -> Iterator[None]:
    from torch._guards import TracingContext

    ctx = TracingContext(capture.fake_mode)
    ctx.tensor_to_context = capture.tensor_to_context
    with torch._guards.tracing(ctx):
        yield


def export_joint(
    capture: Capture,
    gm: torch.fx.GraphModule,
    decompositions: dict[Any, Callable[..., Any]] | None,
) -> Any:
    """Trace the (joint) ATen graph of ``gm`` once; returns a JointWithDescriptors.

    AOTAutograd keeps its tracing contexts (fake mode among them) on an
    ExitStack until compilation; we close it here so the user's eager code
    between stages runs normally, and re-enter equivalent contexts in
    :func:`compile_joint`.
    """
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._inductor.compile_fx import run_pre_grad_passes

    if decompositions is None:
        decompositions = default_decompositions()
    with (
        _tracing(capture),
        size_oblivious_context(capture.size_oblivious),
        contextlib.ExitStack() as stack,
    ):
        # Pre-grad passes rewrite the graph in place: they get a copy, the
        # caller's graph (the Dynamo stage's output) stays as it was.
        gm = run_pre_grad_passes(copy_graph_module(gm), capture.fake_inputs)
        return aot_export_joint_with_descriptors(
            stack,
            gm,
            tuple(capture.fake_inputs),
            decompositions=decompositions,
            keep_inference_input_mutations=True,
        )


def joint_needs_autograd(jd: Any) -> bool:
    return bool(jd._aot_state.needs_autograd)


def joint_graph_module(jd: Any) -> torch.fx.GraphModule:
    return jd.graph_module


def joint_placeholder_count(jd: Any) -> int:
    return sum(1 for n in jd.graph_module.graph.nodes if n.op == "placeholder")


def static_input_indices(dynamo_gm: torch.fx.GraphModule) -> list[int]:
    """The graph inputs Dynamo marked static (parameters and buffers of the module),
    as AOTAutograd's ``_try_get_metadata_from_dynamo`` finds them."""
    return [
        i
        for i, node in enumerate(dynamo_gm.graph.find_nodes(op="placeholder"))
        if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    ]


def joint_input_count(jd: Any) -> int:
    return len(jd._aot_state.flat_args)


@contextlib.contextmanager
def _aot_stage2_context(fake_mode: Any) -> Iterator[None]:
    """The contexts AOTAutograd's export left on its stack, entered anew."""
    from torch._decomp.decompositions_for_rng import PhiloxStateTracker
    from torch._dispatch.python import enable_python_dispatcher
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
    from torch._functorch.aot_autograd import preserve_rng_state

    with contextlib.ExitStack() as stack:
        stack.enter_context(compiled_autograd._disable())
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(preserve_rng_state())
        stack.enter_context(fake_mode)
        if fake_mode.shape_env is not None:
            stack.enter_context(enable_python_dispatcher())
        stack.enter_context(PhiloxStateTracker())
        stack.enter_context(_disable_saved_tensors_hooks_during_tracing())
        yield


def inductor_options(options: dict[str, Any] | None) -> contextlib.AbstractContextManager[Any]:
    """Inductor's config patched with ``options`` around a whole capture, not only the
    Inductor stage: decompositions chosen while AOTAutograd traces read it too
    (``coordinate_descent_tuning`` turns a one-row matmul into a tuned reduction)."""
    from torch._inductor import config

    return config.patch(options) if options else contextlib.nullcontext()


def kernels_read_thread_count() -> bool:
    """Whether the C++ kernels Inductor compiles now read OpenMP's thread count as they
    run (``cpp.dynamic_threads``: no team size or per-thread buffer fixed at compile), so
    that the count at the call need not be the count at the capture."""
    from torch._inductor import config

    return bool(config.cpp.dynamic_threads)


def inductor_config_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    from torch._inductor import list_mode_options

    # Short Triton kernel names: Triton cuts cache file names to 150 characters, and a
    # kernel with a longer descriptive name ("triton_poi_fused__scaled_dot_product_...")
    # is then not found by Inductor's static CUDA launcher, so it cannot be shipped.
    patches: dict[str, Any] = {"triton.descriptive_names": False}
    patches.update(list_mode_options(mode) if mode else {})
    patches.update(options or {})
    return patches


def _find_serialize_fn(fn: Any) -> Callable[[], Any] | None:
    from torch._functorch._aot_autograd.runtime_wrappers import (
        SerializableCompiledFunction,
    )

    # AOTAutograd wraps the serializable function in runtime wrappers. Most keep
    # ``__wrapped__``; some (torch 2.11's autograd path) are plain closures, so
    # we also look through ``compiled_fn`` attributes and closure cells.
    seen: set[int] = set()
    todo = [fn]
    while todo and len(seen) < 256:
        fn = todo.pop(0)
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, SerializableCompiledFunction):
            return fn.serialize_fn
        todo.append(getattr(fn, "__wrapped__", None))
        todo.append(getattr(fn, "compiled_fn", None))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and not isinstance(value, type):
                todo.append(value)
    return None


class _FlatCompiledFn:
    """The compiled function with the positional calling convention Dynamo's bytecode uses."""

    def __init__(self, boxed: Callable[[list[Any]], Any], serialize: Callable[[], Any]):
        self._boxed = boxed
        self.serialize = serialize

    def __call__(self, *args: Any) -> Any:
        return self._boxed(list(args))


def _compiler_config_extra(cfx: Any, inductor_config: Any, dynamo_gm: torch.fx.GraphModule) -> Any:
    """Inductor's per-compile boxes (cudagraphs flag, graph id, forward device).

    torch 2.11 takes the Inductor config module; 2.12+ takes the Dynamo graph
    (whose meta may carry a cudagraph annotation) and reads the config itself.
    """
    params = inspect.signature(cfx.create_compiler_config_extra).parameters
    if "config" in params:  # torch <= 2.11
        return cfx.create_compiler_config_extra(inductor_config)
    return cfx.create_compiler_config_extra(dynamo_gm)


def compile_joint(
    capture: Capture,
    exported: Any,
    joint_gm: torch.fx.GraphModule,
    dynamo_gm: torch.fx.GraphModule,
    mode: str | None,
    options: dict[str, Any] | None,
) -> tuple[Any, dict[str, str]]:
    """Partition (if training) and compile ``joint_gm`` with Inductor.

    ``exported`` (from :func:`export_joint`) and ``joint_gm`` are left as they
    were: the compile works on a private copy of both, so they can compile again.
    Returns a SerializableCallable and the generated source of each graph.
    """
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    jd = joint_for_one_compile(exported, joint_gm)
    # The exported joint records no static inputs (export has no Dynamo sources);
    # torch.compile's path reads them off Dynamo's placeholders, as here: the
    # parameters and buffers, read in place by CUDA graphs (reduce-overhead).
    jd._aot_state.fw_metadata.static_input_indices = static_input_indices(dynamo_gm)
    patches = inductor_config_patches(mode, options)
    num_outputs = cfx.get_num_model_outputs(dynamo_gm)
    num_inputs = len(capture.fake_inputs)

    sources: dict[str, str] = {}

    def keep_source(name: str, output_code: Any) -> Any:
        sources[name] = getattr(output_code, "source_code", "") or ""
        return output_code

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        resolve_overload_packets(gm)
        return keep_source(
            "forward",
            cfx.compile_fx_forward(
                gm,
                example_inputs,
                num_orig_model_outputs=num_outputs,
                num_example_inputs=num_inputs,
                compiler_config_extra=extra,
                is_inference=not joint_needs_autograd(jd),
            ),
        )

    def bw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        resolve_overload_packets(gm)
        return keep_source(
            "backward", cfx.compile_fx_backward(gm, example_inputs, compiler_config_extra=extra)
        )

    with contextlib.ExitStack() as stack:
        stack.enter_context(size_oblivious_context(capture.size_oblivious))
        stack.enter_context(stride_order_without_guards(capture.size_oblivious))
        stack.enter_context(bounds_checks_after_their_index())
        stack.enter_context(full_width_byte_loads())
        stack.enter_context(inductor_config.patch(patches))
        # Read under the patch: it boxes config.triton.cudagraphs (mode="reduce-overhead").
        extra = _compiler_config_extra(cfx, inductor_config, dynamo_gm)
        stack.enter_context(_tracing(capture))
        # Inductor reads the static inputs (parameters) for CUDA graphs from the
        # tracing context; AOTAutograd sets it only on its training path.
        torch._guards.TracingContext.get().fw_metadata = jd._aot_state.fw_metadata
        stack.enter_context(V.set_fake_mode(capture.fake_mode))
        stack.enter_context(
            torch._functorch.config.patch(
                {
                    "strict_autograd_cache": True,
                    "bypass_autograd_cache_key": True,
                    "bundled_autograd_cache": True,
                    "force_non_lazy_backward_lowering": True,
                    "force_autograd_cache": True,
                    "unlift_effect_tokens": True,
                }
            )
        )
        stack.enter_context(_aot_stage2_context(capture.fake_mode))
        wrapped = aot_compile_joint_with_descriptors(
            jd,
            partition_fn=cfx.partition_fn,
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            serializable=True,
        )
    boxed = getattr(wrapped, "__wrapped__", wrapped)
    if isinstance(boxed, BundledAOTAutogradSerializableCallable):
        # Training: AOTAutograd already bundled the autograd function (forward and
        # backward) with its cache entry; unwrap it to keep one calling convention.
        boxed = boxed.compiled_fn
    serialize = getattr(boxed, "serialize", None) or _find_serialize_fn(boxed)
    if serialize is None:
        raise RuntimeError(
            "Inductor produced a function that PyTorch cannot serialize; "
            f"this torch version ({torch.__version__}) may not support precompilation of this "
            f"model (AOTAutograd returned {type(boxed).__name__} without a serializable entry)"
        )
    compiled = BundledAOTAutogradSerializableCallable(_FlatCompiledFn(boxed, serialize))
    # PyTorch decides CUDA graphs again at deserialization, from the ambient config.
    compiled._torch_precompile_cudagraphs = bool(patches.get("triton.cudagraphs"))
    return compiled, sources


def compiled_function_uses_cudagraphs(fn: Any) -> bool:
    """Whether an AOTCompiledFunction was compiled with CUDA graphs (reduce-overhead)."""
    return bool(getattr(fn._artifacts.compiled_fn, "_torch_precompile_cudagraphs", False))
