"""The one module that touches PyTorch's private compiler APIs.

Every call into ``torch._dynamo``, ``torch._functorch`` and ``torch._inductor``
internals lives here, so that a PyTorch upgrade is one file's work. The rest of
the package talks to these functions only. Heavy imports happen inside the
functions: loading an artifact must not import the compiler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import pickle
import re
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# Guard kinds PyTorch itself refuses to serialize (object identities of this process).
UNSERIALIZABLE_GUARD_KINDS = (
    "DICT_VERSION",
    "NN_MODULE",
    "ID_MATCH",
    "FUNCTION_MATCH",
    "CLASS_MATCH",
    "MODULE_MATCH",
    "CLOSURE_MATCH",
    "WEAKREF_ALIVE",
)


@dataclasses.dataclass
class Capture:
    """Everything Dynamo's fullgraph capture produced, kept for the later stages."""

    graph_capture_output: Any  # convert_frame.GraphCaptureOutput
    backend_id: str
    graph_module: torch.fx.GraphModule
    fake_inputs: list[Any]
    fake_mode: Any
    tensor_to_context: Any
    traced_fn: types.FunctionType
    bound_self: object | None
    signature: inspect.Signature
    device_type: str
    guards: list[Any]  # torch._guards.Guard
    local_scope: dict[str, Any]
    input_sources: list[str]
    size_oblivious: bool = False
    grad_enabled: bool = True  # grad mode at capture; the guards are built under it


# --------------------------------------------------------------------- dynamo


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import Unsupported, UserError

    return (Unsupported, UserError)


def wants_size_oblivious(args: Any, kwargs: Any) -> bool:
    """Whether an example tensor was marked dynamic with ``min`` 0 or 1.

    Dynamo specialises sizes 0 and 1 unless the ShapeEnv reasons about backed
    sizes "size-obliviously"; honouring ``mark_dynamic(t, d, min=1)`` needs it.
    """
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        for rng in getattr(leaf, "_dynamo_dynamic_range", ()) or ():
            if rng.min is not None and rng.min <= 1:
                return True
    return False


def size_oblivious_context(enabled: bool) -> Any:
    """ShapeEnv setting that keeps 0 and 1 inside a dynamic size's range."""
    if not enabled:
        return contextlib.nullcontext()
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def _argsort_sym_without_guards(
    shape_env: Any, seq: Sequence[Any], *, reverse: bool = False
) -> list[int]:
    """Inductor's ``argsort_sym`` (stride order for layout heuristics), minus its guards.

    PyTorch documents that order as "optimization-only": no correctness
    decision may rest on it. Yet it decides ``128*s1 > 128`` with a guard,
    which narrows a sequence range [1, 128] to [2, 128]. Here, what the shape
    environment knows statically decides, and the example's sizes break ties,
    without adding a guard.
    """
    import sympy

    def as_expr(v: Any) -> Any:
        return v.node.expr if isinstance(v, torch.SymInt) else sympy.sympify(v)

    def less(a: Any, b: Any) -> bool:
        known = shape_env._maybe_evaluate_static(sympy.Lt(a, b))
        if known is not None:
            return bool(known)
        return shape_env.optimization_hint(a) < shape_env.optimization_hint(b)

    def cmp(a: tuple[int, Any], b: tuple[int, Any]) -> int:
        if less(a[1], b[1]):
            return -1
        if less(b[1], a[1]):
            return 1
        return 1 if a[0] < b[0] else -1 if a[0] > b[0] else 0

    exprs = [(i, as_expr(v)) for i, v in enumerate(seq)]
    exprs = sorted(exprs, key=functools.cmp_to_key(cmp), reverse=reverse)
    return [i for i, _ in exprs]


@contextlib.contextmanager
def _stride_order_without_guards(enabled: bool) -> Iterator[None]:
    """Keep Inductor's stride-order heuristic from narrowing dynamic ranges."""
    if not enabled:
        yield
        return
    from torch._inductor import ir, utils

    saved = (ir.argsort_sym, utils.argsort_sym)
    ir.argsort_sym = utils.argsort_sym = _argsort_sym_without_guards  # type: ignore[assignment]
    try:
        yield
    finally:
        ir.argsort_sym, utils.argsort_sym = saved  # type: ignore[assignment]


@contextlib.contextmanager
def _capture_context(dynamic: bool | None) -> Iterator[None]:
    from torch._dynamo.eval_frame import set_enable_dynamic
    from torch._dynamo.utils import get_metrics_context
    from torch._dynamo.variables.torch_function import (
        torch_function_mode_stack_state_mgr,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(get_metrics_context())
        stack.enter_context(torch._functorch.config.patch(strict_autograd_cache=True))
        if dynamic is not None:
            stack.enter_context(set_enable_dynamic(dynamic))
        # Python floats (dropout p, LayerNorm eps) stay constants: symbolic floats
        # make AOTAutograd ask Dynamo to restart the trace, which a staged
        # pipeline cannot do once the capture is handed on.
        stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
        if dynamic is None:
            # Static unless marked: no "automatic dynamic" from earlier captures of
            # the same code in this process, so a capture does not depend on history.
            stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
        stack.enter_context(torch_function_mode_stack_state_mgr)
        yield


def fullgraph_capture(
    model: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic: bool | None,
    size_oblivious: bool = False,
) -> Capture:
    """Run Dynamo's fullgraph capture; raises Dynamo's own exceptions on failure."""
    from torch._dynamo import convert_frame
    from torch._dynamo.graph_utils import _graph_device_type

    with _capture_context(dynamic), size_oblivious_context(size_oblivious):
        out = convert_frame.fullgraph_capture(model, args, kwargs)
    gco = out.graph_capture_output
    backend_input = out.backend_input
    if backend_input is None:
        raise ValueError("the model computes nothing with tensors, so there is no graph to compile")
    fn, bound_self = convert_frame.get_traced_fn(model)
    gm = backend_input.graph_module
    gm._backend_id = backend_input.backend_id  # type: ignore[assignment]
    og = gco.output_graph
    sources = [
        source.name
        for _, source in sorted(og.export_metadata.graph_input_idx_to_local_source.items())
    ]
    return Capture(
        graph_capture_output=gco,
        backend_id=backend_input.backend_id,
        graph_module=gm,
        fake_inputs=list(backend_input.example_inputs),
        fake_mode=backend_input.fake_mode,
        tensor_to_context=backend_input.tensor_to_context,
        traced_fn=fn,
        bound_self=bound_self,
        signature=convert_frame._get_signature(fn),
        device_type=_graph_device_type(gm.graph),
        guards=list(og.guards),
        local_scope=og.local_scope,
        input_sources=sources,
        size_oblivious=size_oblivious,
        grad_enabled=torch.is_grad_enabled(),
    )


def is_capture_error(exc: BaseException) -> bool:
    return isinstance(exc, _dynamo_errors())


def shape_env_guard_exprs(capture: Capture) -> list[str]:
    """The symbolic-shape guards recorded so far, as readable expressions."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return []
    return [str(g.expr) for g in shape_env.guards]


def shape_env_var_ranges(capture: Capture) -> dict[str, tuple[int, int | None]]:
    """Value ranges of the symbols of the capture (for dynamic-shape messages)."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return {}
    out = {}
    ranges = shape_env.var_to_range
    for sym, vr in ranges.items():
        # A symbol found equal to another (s18 == s72) keeps a stale range of
        # its own; what holds is the range of what it was replaced by.
        rep = shape_env.replacements.get(sym)
        if rep is not None and rep in ranges:
            vr = ranges[rep]
        elif rep is not None and getattr(rep, "is_number", False):
            out[str(sym)] = (int(rep), int(rep))
            continue
        out[str(sym)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    return out


def _bound(value: Any) -> int | None:
    """A finite sympy bound as int; None for (int_)oo."""
    try:
        return int(value) if bool(value.is_finite) else None
    except (TypeError, AttributeError, ValueError):
        return None


def shape_env_symbol_sources(capture: Capture) -> dict[str, str]:
    """Map each shape symbol (``s0``) to the first input dimension it stands for."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return {}
    return {
        str(sym): sources[0].name for sym, sources in shape_env.var_to_sources.items() if sources
    }


# -------------------------------------------------------------- aot_autograd


def default_decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


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
        gm = run_pre_grad_passes(gm, capture.fake_inputs)
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


def set_joint_graph_module(jd: Any, gm: torch.fx.GraphModule) -> None:
    jd.graph_module = gm


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


def inductor_config_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = dict(list_mode_options(mode) if mode else {})
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
    jd: Any,
    dynamo_gm: torch.fx.GraphModule,
    mode: str | None,
    options: dict[str, Any] | None,
) -> tuple[Any, dict[str, str]]:
    """Partition (if training) and compile with Inductor.

    Returns a SerializableCallable and the generated source of each graph.
    """
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    patches = inductor_config_patches(mode, options)
    num_outputs = cfx.get_num_model_outputs(dynamo_gm)
    num_inputs = len(capture.fake_inputs)

    sources: dict[str, str] = {}

    def keep_source(name: str, output_code: Any) -> Any:
        sources[name] = getattr(output_code, "source_code", "") or ""
        return output_code

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
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
        return keep_source(
            "backward", cfx.compile_fx_backward(gm, example_inputs, compiler_config_extra=extra)
        )

    with contextlib.ExitStack() as stack:
        stack.enter_context(size_oblivious_context(capture.size_oblivious))
        stack.enter_context(_stride_order_without_guards(capture.size_oblivious))
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


# --------------------------------------------------------------- precompile


@contextlib.contextmanager
def _reducer_override_patched(pickler: type, override: Callable[..., Any]) -> Iterator[None]:
    """Swap a PyTorch pickler's reducer_override for the duration of one save."""
    original = pickler.reducer_override
    pickler.reducer_override = override  # type: ignore[method-assign]
    try:
        yield
    finally:
        pickler.reducer_override = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _modules_pickled_by_state() -> Iterator[None]:
    """Pickle nn.Modules in the guard state as plain ``nn.Module`` objects.

    Dynamo's guard state keeps the traced frame's locals, ``self`` included;
    PyTorch pickles a module-level class by reference, so loading would need
    the model's class to be importable. Guards on module *types* are dropped
    by our filter, so a plain module with the same attributes rebuilds the
    same guard tree.
    """
    from torch._dynamo.guards import GuardsStatePickler

    original = GuardsStatePickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if (
            isinstance(obj, torch.nn.Module)
            and type(obj) is not torch.nn.Module
            and type(obj).__getstate__ is torch.nn.Module.__getstate__
            and id(obj) in self.guard_tree_values
            and not isinstance(obj, torch.nn.parallel.DistributedDataParallel)
        ):
            original(self, obj)  # records missing values as a side effect
            return GuardsStatePickler._unpickle_module, (obj.__getstate__(),)
        return original(self, obj)

    with _reducer_override_patched(GuardsStatePickler, reducer_override):
        yield


def guard_filter_entry_fields(entry: Any) -> tuple[str, str, bool, Any]:
    """(name, guard_type, is_global, value) of a Dynamo GuardFilterEntry."""
    return entry.name, entry.guard_type, entry.is_global, entry.value


def guard_filter_entry_derived_kinds(entry: Any) -> tuple[str, ...]:
    """The guard kinds a Dynamo GuardFilterEntry is built on (BUILTIN_MATCH -> ID_MATCH)."""
    return tuple(getattr(entry, "derived_guard_types", ()) or ())


def guard_filter_entry_source(entry: Any) -> str:
    """The full source of a GuardFilterEntry (``L['x']``; its ``name`` drops the ``L[...]``)."""
    orig = getattr(entry, "orig_guard", None)
    return getattr(orig, "name", None) or entry.name


def build_guard_manager(
    capture: Capture, guard_filter: Callable[[Sequence[Any]], Sequence[bool]]
) -> tuple[Any, bytes]:
    """Build Dynamo's guard manager after compilation (so shape guards added by
    AOTAutograd and Inductor are included) and its serialized state."""
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._dynamo.variables.torch_function import (
        torch_function_mode_stack_state_mgr,
    )

    hooks = Hooks(guard_filter_fn=guard_filter)
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_metrics_context())
        stack.enter_context(dynamo_timed("torch_precompile.build_guards"))
        if torch_function_mode_stack_state_mgr.stack:
            stack.enter_context(torch_function_mode_stack_state_mgr.temp_restore_stack())
        stack.enter_context(_modules_pickled_by_state())
        # Dynamo checks the new guards against the current global state: restore the
        # capture's grad mode, so precompile() may run outside the capture's no_grad block.
        stack.enter_context(torch.set_grad_enabled(capture.grad_enabled))
        check_fn = capture.graph_capture_output.build_guards(
            capture.traced_fn.__code__, hooks=hooks, save=True, strict_error=True
        )
    if check_fn.guards_state is None:
        raise RuntimeError("Dynamo produced no serializable guard state")
    return check_fn.guard_manager, check_fn.guards_state


def make_compiled_function(
    capture: Capture, compiled_fn: Any, guard_manager: Any, guards_state: bytes
) -> Any:
    """Assemble PyTorch's AOTCompiledFunction (what ``aot_compile`` returns)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction, CompileArtifacts
    from torch._dynamo.package import SourceInfo

    gco = capture.graph_capture_output
    source_info = SourceInfo(inlined_sources=set())
    for code in gco.traced_code:
        source_info.add_code(code)
    artifacts = CompileArtifacts(
        signature=capture.signature,
        guard_manager=guard_manager,
        guards_state=guards_state,
        backend_id=capture.backend_id,
        compiled_fn=compiled_fn,
        original_code=capture.traced_fn.__code__,
        runtime_env=gco.get_runtime_env(),
        source_info=source_info,
        device_type=capture.device_type,
        backend_name="inductor",
    )
    return AOTCompiledFunction(_artifacts=artifacts, _extra_globals=capture.traced_fn.__globals__)


def findable_by_name(fn: types.FunctionType) -> bool:
    """Whether pickle can find ``fn`` by module and qualified name (it is that object)."""
    import sys

    if "<locals>" in fn.__qualname__:
        return False
    obj: Any = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _rebuild_function(
    code: types.CodeType,
    module: str,
    name: str,
    qualname: str,
    defaults: tuple[Any, ...] | None,
    kwdefaults: dict[str, Any] | None,
    closure: tuple[Any, ...] | None,
    attrs: dict[str, Any],
) -> types.FunctionType:
    """Inverse of the by-value reduction in :func:`_functions_pickled_by_value`."""
    import importlib

    try:
        f_globals = importlib.import_module(module).__dict__
    except ImportError:
        # The code runs nowhere (Dynamo traced it into the graph); it is kept
        # so that guards and closures that hold it can be rebuilt.
        f_globals = {"__name__": module, "__builtins__": __builtins__}
    fn = types.FunctionType(code, f_globals, name, defaults, closure)
    fn.__qualname__ = qualname
    fn.__kwdefaults__ = kwdefaults
    fn.__dict__.update(attrs)
    return fn


@contextlib.contextmanager
def _functions_pickled_by_value() -> Iterator[None]:
    """Pickle functions that pickle cannot find by qualified name by value.

    A decorated method (``functools.wraps``) keeps the undecorated function in
    its closure under the same qualified name, which now names the wrapper;
    pickle by reference fails on it ("not the same object as ..."). PyTorch
    already saves ``<locals>`` functions by value; this covers the rest.
    """
    from torch._dynamo.aot_compile import AOTCompilePickler

    original = AOTCompilePickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        by_value = inspect.isfunction(obj) and "<locals>" not in obj.__qualname__
        if by_value and not findable_by_name(obj):
            return _rebuild_function, (
                obj.__code__,
                obj.__module__,
                obj.__name__,
                obj.__qualname__,
                obj.__defaults__,
                obj.__kwdefaults__,
                obj.__closure__,
                dict(obj.__dict__),
            )
        return original(self, obj)

    with _reducer_override_patched(AOTCompilePickler, reducer_override):
        yield


def serialize_compiled_function(fn: Any) -> bytes:
    """PyTorch's own AOTCompiledFunction serialization (unfindable functions by value)."""
    if isinstance(fn, FastCompiledFunction):
        return fn.serialized  # loaded by the fast path: the bytes it was loaded from
    from torch._dynamo.aot_compile import AOTCompiledFunction

    with _functions_pickled_by_value():
        return AOTCompiledFunction.serialize(fn).serialized_data


def external_global_refs(fn: Any) -> dict[str, list[str]]:
    """Globals the saved bytecode reads but PyTorch does not save (e.g. an output
    dataclass), each as ``[module, qualified name]`` to import at load."""
    env = fn._artifacts.runtime_env
    scope = fn._extra_globals or {}
    refs: dict[str, list[str]] = {}
    provided = {fn._artifacts.backend_id, *env.used_globals, *env.import_sources}
    for name in sorted(set(env.external_refs) - provided):
        obj = scope.get(name)
        if isinstance(obj, types.ModuleType):
            refs[name] = [obj.__name__, ""]
            continue
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str) and "<locals>" not in qualname:
            refs[name] = [module, qualname]
        elif "__name__" in scope:
            refs[name] = [scope["__name__"], name]
    return refs


def import_global_refs(refs: dict[str, list[str]]) -> dict[str, Any]:
    """Inverse of :func:`external_global_refs`: import each referenced object."""
    import importlib

    out: dict[str, Any] = {}
    for name, (module, qualname) in refs.items():
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split(".") if qualname else ():
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"the artifact's code uses {module}.{qualname} (as {name!r}), which cannot be "
                f"imported here: {exc}; output types and other globals the model returns or "
                "calls after its graph must be importable where the artifact is loaded"
            ) from exc
        out[name] = obj
    return out


def unresolved_globals(fn: Any) -> list[str]:
    """Globals the bytecode reads that PyTorch's serialization does not carry
    (e.g. an output dataclass): they must come from the model's module at load."""
    arts = fn._artifacts
    env = arts.runtime_env
    known = set(env.import_sources) | set(env.used_globals) | {arts.backend_id}
    return sorted(ref for ref in env.external_refs if ref not in known)


def deserialize_compiled_function(
    data: bytes, f_globals: dict[str, Any] | None = None, *, cudagraphs: bool = False
) -> Any:
    """Inverse of :func:`serialize_compiled_function`.

    ``cudagraphs``: the artifact was compiled with ``mode="reduce-overhead"``.
    PyTorch's bundled AOTAutograd entry decides whether to wrap the graphs in
    CUDA graphs from ``config.triton.cudagraphs`` *at deserialization*, so we
    set it for the duration of the call.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, compile_context

    with contextlib.ExitStack() as stack:
        if cudagraphs:
            from torch._inductor import config as inductor_config

            stack.enter_context(inductor_config.patch({"triton.cudagraphs": True}))
        stack.enter_context(compile_context(CompileContext(convert_frame.get_compile_id({}))))
        stack.enter_context(get_metrics_context())
        fn = AOTCompiledFunction.deserialize(data, f_globals=f_globals)
    if cudagraphs:
        fn._artifacts.compiled_fn._torch_precompile_cudagraphs = True
    return fn


def begin_cudagraph_step() -> None:
    """Start a new CUDA-graph generation before a call of a reduce-overhead artifact.

    Inductor's CUDA graph trees replay from the root only in a new "generation";
    torch.compile bumps Dynamo's generation counter on every call of a compiled
    module, which calling the compiled bytecode directly does not do. Without
    this every call would record a new graph. As with torch.compile, a call may
    overwrite the outputs of the previous one.
    """
    from torch._dynamo.mutation_guard import GenerationTracker

    GenerationTracker.generation += 1


# ------------------------------------- shipped CPU kernels on PyTorch's full path
# Artifacts that do not take the fast path (dynamic shapes, training, closures,
# variants) load through PyTorch's deserialization, which re-creates Inductor's
# wrapper modules; each wrapper asks ``CppPythonBindingsCodeCache`` for its C++
# kernels, which compiles them on a cache miss. The artifact's ``kernels``
# section carries the shared objects built at save; while a compiled function is
# deserialized, a kernel whose key is among them is loaded from the shipped file.

_SHIPPED_KERNELS: dict[str, Any] = {}  # kernel key -> shipped kernel loaded in this process


def _compiled_graph_sources(fn: Any) -> list[str]:
    """The Inductor wrapper source of each compiled graph (forward, backward) of ``fn``."""
    entry = fn._artifacts.compiled_fn.compiled_fn.serialize()
    sources = []
    for part in (entry.compiled_fw, getattr(entry, "compiled_bw", None)):
        graph = getattr(part, "result", None)
        source = getattr(graph, "source_code", None)
        if source:
            sources.append(source)
    return sources


def _kernel_file_without_compiling(argtypes: list[str], source: str) -> str | None:
    """The ``.so`` of a kernel that Inductor built (or found on disk) in this process.

    A cache miss must not start a compile at save: C++ builds are refused while
    looking up (the miss then reads as None). Inductor's first compile of a
    process probes the CPU's vector ISA with a test build; if that probe never
    ran here, nothing was compiled in this process and the lookup is skipped
    (refusing the probe's build would cache a wrong ISA).
    """
    from torch._inductor import cpp_builder, cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return None

    class _WouldCompile(Exception):
        pass

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _WouldCompile(self.get_target_file_path())

    original = cpp_builder.CppBuilder.build
    cpp_builder.CppBuilder.build = refuse  # type: ignore[method-assign]
    try:
        kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
        return kernel.__self__.__file__
    except _WouldCompile:
        return None
    finally:
        cpp_builder.CppBuilder.build = original  # type: ignore[method-assign]


def cpu_kernel_section(fns: Sequence[Any]) -> bytes | None:
    """The ``kernels`` section for CPU compiled functions (all variants, forward and backward).

    Each C++ kernel of each wrapper is looked for among the shipped kernels
    loaded in this process, then in Inductor's code cache (no compile); a kernel
    found in neither is left out (loading then compiles it). None if no kernel
    was found.
    """
    from . import _fastpath

    log = logging.getLogger("torch_precompile")
    binaries: dict[str, bytes] = {}
    missing = 0
    for fn in fns:
        if isinstance(fn, FastCompiledFunction):
            binaries.update((k, bytes(v)) for k, v in _fastpath.unpack_kernels(fn.kernels).items())
            continue
        try:
            sources = _compiled_graph_sources(fn)
        except Exception as exc:  # an unexpected PyTorch structure: ship nothing for it
            log.debug("no shipped kernels for a compiled function: %s", exc)
            continue
        for source in sources:
            try:
                calls = _recorded_kernels(source)
            except Exception as exc:
                log.debug("cannot list the kernels of a wrapper: %s", exc)
                continue
            for argtypes, kernel_source in calls:
                key = _fastpath.kernel_key(argtypes, kernel_source)
                if key in binaries:
                    continue
                shipped = _SHIPPED_KERNELS.get(key)
                try:
                    if shipped is not None:
                        path = shipped.__self__.__file__
                    else:
                        path = _kernel_file_without_compiling(argtypes, kernel_source)
                    if path is not None:
                        with open(path, "rb") as f:
                            binaries[key] = f.read()
                        continue
                except Exception as exc:
                    log.debug("kernel %s not found: %s", key[:12], exc)
                missing += 1
    if missing:
        log.debug("%d kernels not shipped: loading will compile them", missing)
    return _fastpath.pack_kernels(binaries) if binaries else None


def shipped_kernels_enabled() -> bool:
    """``TORCH_PRECOMPILE_SHIPPED_KERNELS=0`` makes the full path compile every kernel."""
    import os

    return os.environ.get("TORCH_PRECOMPILE_SHIPPED_KERNELS", "1") != "0"


@contextlib.contextmanager
def _pybindings_from(lookup: Callable[[str, list[str], str], Any]) -> Iterator[None]:
    """Inductor's ``CppPythonBindingsCodeCache`` asks ``lookup(key, argtypes, source)``
    first; a kernel it returns is used as is, None compiles (or hits the cache) as before.

    Only this class's ``load_pybinding_async`` (what the wrapper's
    ``async_compile.cpp_pybinding`` and ``load_pybinding`` call) is patched, for
    the duration of the block.
    """
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from . import _fastpath

    previous = CppPythonBindingsCodeCache.__dict__["load_pybinding_async"]

    def load_pybinding_async(cls: Any, argtypes: Any, main_code: str, *a: Any, **kw: Any) -> Any:
        # Subclasses append another binding suffix: only the plain class's kernels match.
        if cls is CppPythonBindingsCodeCache and not a and set(kw) <= {"submit_fn"}:
            kernel = lookup(_fastpath.kernel_key(argtypes, main_code), list(argtypes), main_code)
            if kernel is not None:
                return lambda: kernel
        return previous.__func__(cls, argtypes, main_code, *a, **kw)

    CppPythonBindingsCodeCache.load_pybinding_async = classmethod(load_pybinding_async)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CppPythonBindingsCodeCache.load_pybinding_async = previous  # type: ignore[method-assign]


@contextlib.contextmanager
def shipped_cpu_kernels(kernels_section: bytes | None) -> Iterator[None]:
    """While active, Inductor loads the shipped kernels instead of compiling them.

    A kernel whose key is in the section is written to the fast path's private
    directory and imported as the fast path does; any other kernel compiles as
    before. PyTorch loads both the forward and the backward wrapper while
    deserializing, so the patch lasts for that call only.
    """
    if not kernels_section or not shipped_kernels_enabled():
        yield
        return
    from . import _fastpath

    log = logging.getLogger("torch_precompile")
    kernels = _fastpath.unpack_kernels(kernels_section)
    directory: list[str] = []  # made on the first shipped kernel asked for
    guards_c = torch._C._dynamo.guards  # type: ignore[attr-defined]
    data_ptr = str(guards_c._torchinductor_pyobject_tensor_data_ptr)

    def lookup(key: str, argtypes: list[str], source: str) -> Any:
        if key not in kernels:
            log.debug("kernel %s is not shipped: compiling it", key[:12])
            return None
        try:
            if not directory:
                directory.append(_fastpath._kernel_dir(kernels_section))
            loader = _fastpath._KernelLoader(kernels, directory[0], data_ptr)
            kernel = loader.cpp_pybinding(argtypes, source)
        except Exception as exc:
            log.warning("shipped kernel %s failed to load, compiling it: %s", key[:12], exc)
            return None
        _SHIPPED_KERNELS[key] = kernel
        return kernel

    with _pybindings_from(lookup):
        yield


@contextlib.contextmanager
def reusing_shipped_kernels() -> Iterator[None]:
    """Kernels this process loaded from artifacts are found as if Inductor had built
    them: saving an artifact loaded through the full path reads them, never compiles."""
    if not _SHIPPED_KERNELS:
        yield
        return
    with _pybindings_from(lambda key, argtypes, source: _SHIPPED_KERNELS.get(key)):
        yield


def compiled_function_parts(fn: Any) -> tuple[Any, Callable[..., Any], inspect.Signature]:
    """(guard manager, runtime callable, signature) of an AOTCompiledFunction."""
    return fn._artifacts.guard_manager, fn.fn, fn._artifacts.signature


def compiled_function_closure_locals(fn: Any) -> dict[str, Any]:
    """The closure variables the guards of an AOTCompiledFunction read."""
    env = fn._artifacts.runtime_env
    if not env.closure:
        return {}
    return {name: cell.cell_contents for name, cell in zip(env.bytecode.co_freevars, env.closure)}


def guard_failure_reason(guard_manager: Any, f_locals: dict[str, Any]) -> str:
    """Dynamo's own one-line reason for a failed guard check."""
    info = guard_manager.check_verbose(f_locals)
    parts = [p for p in info.verbose_code_parts if p]
    return "; ".join(parts) if parts else "a guard failed"


def compiled_function_signature(fn: Any) -> inspect.Signature:
    return fn._artifacts.signature


def compiled_function_bytecode(fn: Any) -> types.CodeType:
    return fn._artifacts.runtime_env.bytecode


def compiled_function_device_type(fn: Any) -> str:
    return fn._artifacts.device_type


def compiled_graph_callable(fn: Any) -> Callable[..., Any]:
    """The compiled graph of an AOTCompiledFunction: called with the flat graph
    inputs (in Dynamo's graph-input order), returns the flat graph outputs."""
    return fn.fn.__globals__[fn._artifacts.backend_id]


def compiled_function_globals(fn: Any) -> dict[str, Any]:
    """The globals Dynamo's bytecode runs with (what a ``G['name']`` source reads)."""
    return fn.fn.__globals__


@contextlib.contextmanager
def recording_compiled_graph(fn: Any) -> Iterator[list[tuple[tuple[Any, ...], Any]]]:
    """Record each call of the compiled graph (flat inputs, flat outputs) made
    through the AOTCompiledFunction's bytecode, to map outputs to graph outputs."""
    f_globals = fn.fn.__globals__
    key = fn._artifacts.backend_id
    original = f_globals[key]
    calls: list[tuple[tuple[Any, ...], Any]] = []

    def record(*args: Any) -> Any:
        out = original(*args)
        calls.append((args, out))
        return out

    f_globals[key] = record
    try:
        yield calls
    finally:
        f_globals[key] = original


def global_state_snapshot() -> dict[str, Any]:
    """The global state Dynamo guards on, in words, for diagnosing guard failures."""
    return {
        "grad mode": torch.is_grad_enabled(),
        "default dtype": str(torch.get_default_dtype()).replace("torch.", ""),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "num threads": torch.get_num_threads(),
        "autocast": torch.is_autocast_enabled("cpu")
        or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")),
    }


# ------------------------------------------------- cold start: CPU fast load


@dataclasses.dataclass
class FastCompiledFunction:
    """A compiled function loaded by the fast path (see ``_fastpath``).

    Shaped like PyTorch's ``AOTCompiledFunction`` where the runtime reads it
    (``_artifacts.guard_manager``, ``.signature``, ``.runtime_env``,
    ``.device_type``; ``fn``), and keeps the bytes it was loaded from so that
    saving it again writes the same sections.
    """

    _artifacts: Any
    fn: Callable[..., Any]
    serialized: bytes
    fastload: bytes
    kernels: bytes
    _extra_globals: dict[str, Any] | None = None  # the globals imported at load

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.aot_compile import bind_locals

        f_locals = bind_locals(self._artifacts.signature, *args, **kwargs)
        if not self._artifacts.guard_manager.check(f_locals):
            raise RuntimeError("GuardManager check failed")
        return self.fn(*args, **kwargs)


def _fast_load_refusal(fn: Any) -> tuple[str | None, Any, Any]:
    """Why ``fn`` cannot take the fast path (None if it can), its AOTAutograd entry and graph."""
    artifacts = fn._artifacts
    if artifacts.device_type != "cpu":
        return f"device {artifacts.device_type}", None, None
    env = artifacts.runtime_env
    if env.closure:
        return "the traced function has a closure", None, None
    entry = artifacts.compiled_fn.compiled_fn.serialize()
    if entry.compiled_bw is not None or entry.num_fw_outs_saved_for_bw:
        return "training artifact", None, None
    if entry.maybe_subclass_meta is not None:
        return "tensor subclass inputs", None, None
    if any(getattr(w, "needs_post_compile", True) for w in entry.dispatch_wrappers):
        return "duplicated or aliased inputs", None, None
    if entry.indices_of_inps_to_detach:
        return "inputs to detach", None, None
    meta = entry.runtime_metadata
    for info in meta.input_info:
        if info.mutates_data or info.mutates_metadata or info.mutates_storage_metadata:
            return "the graph mutates an input", None, None
    for info in meta.output_info:
        if info.output_type.name != "non_alias":
            return f"an output is {info.output_type.name}", None, None
    if meta.num_intermediate_bases or meta.tokens or getattr(meta, "num_unsafe_view_outputs", 0):
        return "intermediate bases or effect tokens", None, None
    if entry.sanitized_aot_config.dynamic_shapes:
        return "dynamic shapes", None, None
    graph = entry.compiled_fw.result
    if set(graph.device_types) - {"cpu"}:
        return f"devices {sorted(graph.device_types)}", None, None
    if graph.constants or graph.torchbind_constants or graph.mutated_inputs or graph.partition_maps:
        return "constants, mutated inputs or partitions in the compiled graph", None, None
    return None, entry, graph


def cpu_kernel_binaries(fn: Any, bound_self: Any = None) -> tuple[bytes, bytes] | None:
    """The ``fastload`` and ``kernels`` sections of a CPU inference artifact, or None.

    Run at save, in a process where Inductor built (or can build) the kernels:
    each C++ kernel of the wrapper is looked up in Inductor's code cache (a
    hit right after compiling) and its shared object is read back.
    """
    import marshal
    import re

    from . import _fastpath

    if isinstance(fn, FastCompiledFunction):
        return fn.fastload, fn.kernels
    if not hasattr(fn, "_artifacts"):
        return None
    try:
        reason, _, graph = _fast_load_refusal(fn)
    except Exception as exc:  # an unexpected PyTorch structure: keep the full path
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        logging.getLogger("torch_precompile").debug("no fast load: %s", reason)
        return None
    source = graph.source_code
    refusal = _wrapper_refusal(source)
    if refusal is not None:
        logging.getLogger("torch_precompile").debug("no fast load: %s", refusal)
        return None
    from torch._inductor import select_algorithm
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    extern_names = sorted(set(re.findall(r"\bextern_kernels\.(\w+)", source)))
    for name in extern_names:
        kernel = getattr(select_algorithm.extern_kernels, name, None)
        if kernel is None or kernel is not getattr(torch, name, None):
            logging.getLogger("torch_precompile").debug("no fast load: extern kernel %s", name)
            return None
    binaries: dict[str, bytes] = {}
    for argtypes, kernel_source in _recorded_kernels(source):
        kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, kernel_source)
        with open(kernel.__self__.__file__, "rb") as f:
            binaries[_fastpath.kernel_key(argtypes, kernel_source)] = f.read()
    env = fn._artifacts.runtime_env
    try:
        used_globals = pickle.dumps(dict(env.used_globals), protocol=pickle.HIGHEST_PROTOCOL)
        signature = pickle.dumps(fn._artifacts.signature, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        logging.getLogger("torch_precompile").debug("no fast load: %s", exc)
        return None
    spec = {
        "version": _fastpath.FASTLOAD_VERSION,
        "torch": torch.__version__,
        "wrapper": source,
        "extern_kernels": extern_names,
        "inputs_to_check": [int(i) for i in (graph.inputs_to_check or ())],
        "bytecode": marshal.dumps(env.bytecode),
        "import_sources": dict(env.import_sources),
        "used_globals": used_globals,
        "used_global_names": sorted(env.used_globals),
        "external_refs": sorted(env.external_refs),
        "argdefs": env.argdefs,
        "kwdefaults": env.kwdefaults,
        "backend_id": fn._artifacts.backend_id,
        "signature": signature,
        "original_code": marshal.dumps(fn._artifacts.original_code),
        "guards_state": fn._artifacts.guards_state,
        "light_guards": light_guard_spec(fn._artifacts.guard_manager, bound_self),
    }
    return pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL), _fastpath.pack_kernels(binaries)


def _wrapper_refusal(source: str) -> str | None:
    """Why Inductor's wrapper cannot run with the fast path's stand-ins (None if it can)."""
    import re

    from . import _fastpath

    bad = _fastpath.wrapper_inductor_imports(source)
    if bad:
        return f"the wrapper imports {bad[0]!r}"
    main = source.split('\nif __name__ == "__main__":', 1)[0]
    for name in ("run_intermediate_hooks", "maybe_profile"):
        if main.count(name) > 1:
            return f"the wrapper calls {name}"
    methods = set(re.findall(r"\basync_compile\.(\w+)", main))
    if methods - {"cpp_pybinding", "wait"}:
        return f"the wrapper compiles {sorted(methods - {'cpp_pybinding', 'wait'})} kernels"
    return None


def _recorded_kernels(source: str) -> list[tuple[list[str], str]]:
    """The (argtypes, source) of each ``async_compile.cpp_pybinding`` call of the wrapper."""
    from . import _fastpath

    calls: list[tuple[list[str], str]] = []

    class Recorder:
        def __call__(self) -> Any:
            return self

        def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Any:
            calls.append((list(argtypes), source_code))
            return None

        def wait(self, scope: Any) -> None:
            pass

    namespace: dict[str, Any] = {
        "run_intermediate_hooks": None,
        "maybe_profile": None,
        "align": None,
        "AsyncCompile": Recorder(),
        "extern_kernels": None,
        "__name__": "torch_precompile_wrapper_probe",
    }
    code = compile(_fastpath.strip_wrapper_imports(source), "<inductor wrapper>", "exec")
    exec(code, namespace)
    return calls


def load_fast_compiled_function(
    fastload: bytes,
    kernels: bytes,
    serialized: bytes,
    filename: str,
    module_globals: dict[str, Any] | None = None,
) -> FastCompiledFunction:
    """Rebuild a CPU inference artifact's function from its shipped kernels (no compiler)."""
    import marshal

    from . import _fastpath

    spec = pickle.loads(fastload)
    if spec.get("version") != _fastpath.FASTLOAD_VERSION or spec.get("torch") != torch.__version__:
        raise ValueError("the fast-load section was written by another version")
    guards_c = torch._C._dynamo.guards  # type: ignore[attr-defined]
    data_ptr = str(guards_c._torchinductor_pyobject_tensor_data_ptr)
    graph_call = _fastpath.build_graph_call(
        spec["wrapper"],
        spec["extern_kernels"],
        spec["inputs_to_check"],
        kernels,
        data_ptr,
        filename,
    )
    fn = _fastpath.bytecode_function(spec, graph_call, module_globals)
    original_code = marshal.loads(spec["original_code"])
    light = None
    if spec.get("light_guards") is not None:
        try:
            light = LightGuards(spec["light_guards"])
        except Exception as exc:
            logging.getLogger("torch_precompile").debug("light guards unavailable: %s", exc)
    guard_manager = TieredGuardManager(
        light,
        functools.partial(_load_guard_manager, spec["guards_state"], original_code, fn.__globals__),
    )
    if light is None:
        guard_manager.full  # noqa: B018 - build now, so that a failure falls back at load
    runtime_env = types.SimpleNamespace(
        bytecode=fn.__code__,
        closure=None,
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
        device_type="cpu",
        original_code=original_code,
    )
    return FastCompiledFunction(artifacts, fn, serialized, fastload, kernels, module_globals)


# Light guards: Dynamo's guard tree, translated at save time into a plain-Python
# check that is at least as strict as Dynamo's (any leaf or accessor we do not
# know means no light guards). At load it runs without importing torch._dynamo;
# when it fails, Dynamo's own guard manager is built and decides.

_TENSOR_RE = re.compile(
    r"check_tensor\((?P<src>.*?), (?P<cls>\w+), (?P<keys>DispatchKeySet\([^)]*\)), "
    r"torch\.(?P<dtype>\w+), device=(?P<dev>None|\d+), requires_grad=(?P<rg>True|False), "
    r"size=\[(?P<size>[^\]]*)\], stride=\[(?P<stride>[^\]]*)\]\)"
)
_LIGHT_TYPES: dict[str, type] = {
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "NoneType": type(None),
    "torch.Size": torch.Size,
}
_SAVED_TENSOR_HOOKS_GUARD = (
    "torch._functorch.aot_autograd.utils.top_saved_tensors_hooks ids == None"
)


class _NoLightGuards(Exception):
    """A guard the light check cannot express."""


def _code_part(leaf: Any) -> str:
    # One expression, possibly recorded once per place that needed it.
    parts = {part.split("  #", 1)[0].strip() for part in leaf.verbose_code_parts()}
    if len(parts) != 1:
        raise _NoLightGuards(f"{type(leaf).__name__} with {len(parts)} different code parts")
    return parts.pop()


def _rhs_after(text: str, op: str) -> Any:
    import ast

    if op not in text:
        raise _NoLightGuards(text)
    return ast.literal_eval(text.rsplit(op, 1)[1].strip())


def _light_leaf(leaf: Any, value: Any, has_value: bool) -> list[Any]:
    kind = type(leaf).__name__
    if kind == "DIMENSION_DYNAMIC_MARKING_GUARD":
        attrs = []
        for part in leaf.verbose_code_parts():
            m = re.match(r"hasattr\(.*, '(_dynamo_\w+)'\) == False(\s|$)", part)
            if m is None:
                raise _NoLightGuards(part)
            attrs.append(m.group(1))
        return ["no_dynamic_marking", attrs]
    text = _code_part(leaf)
    if kind == "TENSOR_MATCH":
        m = _TENSOR_RE.fullmatch(text)
        if m is None or m["cls"] not in ("Tensor", "Parameter") or m["dev"] != "None":
            raise _NoLightGuards(text)
        size = [int(x) for x in m["size"].split(",") if x.strip()]
        stride = [int(x) for x in m["stride"].split(",") if x.strip()]
        return ["tensor", m["cls"], m["keys"], m["dtype"], m["rg"] == "True", size, stride]
    prefix = "check_no_aliasing("
    if kind == "NO_TENSOR_ALIASING" and text.startswith(prefix) and text.endswith(")"):
        return ["no_aliasing", [s.strip() for s in text[len(prefix) : -1].split(", ")]]
    if kind == "TYPE_MATCH":
        m = re.search(r"type=<class '([\w.]+)'>", leaf.verbose_code_parts()[0])
        if m is None or m.group(1) not in _LIGHT_TYPES:
            raise _NoLightGuards(text)
        return ["type", m.group(1)]
    if kind == "EQUALS_MATCH":
        expected = _rhs_after(text, " == ")
        if has_value and not (type(value) is type(expected) and value == expected):
            raise _NoLightGuards(f"{text}: the saved model does not satisfy it")
        return ["equals", expected]
    if kind in ("NONE_MATCH", "TRUE_MATCH", "FALSE_MATCH"):
        return ["is", {"NONE_MATCH": None, "TRUE_MATCH": True, "FALSE_MATCH": False}[kind]]
    if kind in ("LENGTH_CHECK", "DICT_LENGTH"):
        return ["len", int(_rhs_after(text, " == "))]
    if kind == "DICT_CONTAINS":
        m = re.fullmatch(r"(not )?___dict_contains\((.+?), .*\)", text)
        if m is None:
            raise _NoLightGuards(text)
        import ast

        return ["contains", ast.literal_eval(m.group(2)), m.group(1) is None]
    if kind == "GLOBAL_STATE" and " against " in text:
        return ["global_state", text.split(" against ", 1)[1]]
    if kind == "TORCH_FUNCTION_MODE_STACK" and torch._C._len_torch_function_stack() == 0:
        # The guard passed at build time with an empty stack, so it expects an empty stack.
        return ["no_torch_function_mode"]
    if kind == "DEFAULT_DEVICE" and text.replace(" ", "") == "utils_device.CURRENT_DEVICE==None":
        return ["no_default_device"]
    if kind == "LAMBDA_GUARD" and text == _SAVED_TENSOR_HOOKS_GUARD:
        return ["no_saved_tensor_hooks"]
    raise _NoLightGuards(f"{kind}: {text}")


def _light_step(accessor: Any) -> list[Any]:
    import ast

    text = accessor.repr()
    m = re.fullmatch(r"(\w+)\((.*)\)", text, re.S)
    if m is None:
        if text == "GetGenericDictGuardAccessor":
            return ["vars"]
        raise _NoLightGuards(text)
    kind, arg = m.groups()
    if kind == "FrameLocalsGuardAccessor":
        km = re.match(r"key=('(?:[^'\\]|\\.)*')", arg)
        if km is None:
            raise _NoLightGuards(text)
        return ["local", ast.literal_eval(km.group(1))]
    if kind == "DictGetItemGuardAccessor":
        return ["item", ast.literal_eval(arg)]
    if kind == "GetGenericDictGuardAccessor":
        return ["vars"]
    raise _NoLightGuards(text)


_MISSING = object()


def _apply_step(step: list[Any], value: Any) -> Any:
    kind = step[0]
    if kind == "local":
        return value[step[1]]
    if kind == "vars":
        return value.__dict__
    return value[step[1]]  # "item": a dict entry


def _light_node(manager: Any, value: Any) -> dict[str, Any]:
    has_value = value is not _MISSING
    node: dict[str, Any] = {
        "source": manager.get_source(),
        "leaves": [_light_leaf(leaf, value, has_value) for leaf in manager.get_leaf_guards()],
        "children": [],
    }
    kind = type(manager).__name__
    if kind == "DictGuardManager":
        if not has_value or type(value) is not dict:
            raise _NoLightGuards(f"dict guard on {node['source']} without its saved value")
        entries = manager.get_key_value_managers()
        if len(entries) != len(value):
            raise _NoLightGuards(f"dict guard on {node['source']} covers part of the dict")
        keys, values = list(value), list(value.values())
        node["dict"] = {
            "size": len(value),
            "entries": [
                [
                    int(i),
                    _light_node(k, keys[i]) if k is not None else None,
                    _light_node(v, values[i]) if v is not None else None,
                ]
                for i, (k, v) in sorted(entries.items())
            ],
        }
    elif kind not in ("GuardManager", "RootGuardManager"):
        raise _NoLightGuards(kind)
    for accessor, child in zip(manager.get_accessors(), manager.get_child_managers()):
        step = _light_step(accessor)
        try:
            child_value = _apply_step(step, value) if has_value else _MISSING
        except (KeyError, AttributeError, TypeError, IndexError):
            child_value = _MISSING
        node["children"].append([step, _light_node(child, child_value)])
    return node


def light_guard_spec(guard_manager: Any, bound_self: Any) -> dict[str, Any] | None:
    """Dynamo's guard tree as plain data the light check runs, or None if it cannot."""
    try:
        root = guard_manager.root
        if root.get_epilogue_lambda_guards():
            raise _NoLightGuards("epilogue guards")
        f_locals = {"self": bound_self} if bound_self is not None else {}
        return _light_node(root, f_locals)
    except Exception as exc:  # _NoLightGuards, or a code part we could not parse
        logging.getLogger("torch_precompile").debug("no light guards: %s", exc)
        return None


class LightGuards:
    """The light check: plain Python over ``torch`` and ``torch._C``, no ``torch._dynamo``.

    The saved tree is turned once into one straight-line Python function (as
    Dynamo's own Python guards used to be), which walks the model and inputs
    the way Dynamo's guard manager does.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self._alias_groups: list[list[str]] = []
        self._collect_alias_groups(spec)
        self._alias_sources = {src for group in self._alias_groups for src in group}
        self._consts: dict[str, Any] = {}
        self._lines: list[str] = []
        self._n = 0
        # Tensor leaves are collected by the generated code (``T.append``) and
        # checked together: (python type, dtype, requires_grad, size, stride,
        # dispatch keys) of each, in the order the code appends them.
        self._tensor_checks: list[
            tuple[type, torch.dtype, bool, tuple[int, ...], tuple[int, ...], int]
        ] = []
        self._emit_node(spec, "L", 1)
        body = "\n".join(self._lines)
        source = f"def light_check(L, seen, T):\n{body}\n    return True\n"
        namespace: dict[str, Any] = {
            **self._consts,
            "tf_stack_len": torch._C._len_torch_function_stack,
            "top_hooks": torch._C._autograd._top_saved_tensors_default_hooks,
        }
        from torch.utils import _device

        namespace["utils_device"] = _device
        exec(compile(source, "<torch_precompile light guards>", "exec"), namespace)
        self._fn = namespace["light_check"]
        self.source = source
        # Dynamo compares a tensor's dispatch keys under the thread-local state of
        # the capture, not of the call. That state is found again by trying both
        # inference modes: the one under which tensors with the recorded properties
        # get the recorded keys is where tensor checks run (None: neither, so the
        # Python check runs in the call's own state, which is stricter).
        self._tensor_guards: Any = None
        self._tensor_inference_mode: bool | None = None
        for mode in (torch.is_inference_mode_enabled(), not torch.is_inference_mode_enabled()):
            with torch.inference_mode(mode):
                examples = self._examples_with_recorded_keys()
                if examples is not None:
                    self._tensor_inference_mode = mode
                    self._tensor_guards = self._native_tensor_guards(examples)
                    break

    def check(self, f_locals: dict[str, Any]) -> bool:
        seen: dict[str, Any] = {}
        tensors: list[Any] = []
        try:
            if not self._fn(f_locals, seen, tensors):
                return False
        except (KeyError, AttributeError, TypeError, IndexError, ValueError):
            return False
        mode = self._tensor_inference_mode
        if mode is None or mode == torch.is_inference_mode_enabled():
            tensors_ok = self._tensors_ok(tensors)
        else:
            with torch.inference_mode(mode):
                tensors_ok = self._tensors_ok(tensors)
        if not tensors_ok:
            return False
        for group in self._alias_groups:
            tensors = [seen.get(src) for src in group]
            if any(t is None for t in tensors) or len({id(t) for t in tensors}) != len(tensors):
                return False
            ptrs = {t.untyped_storage().data_ptr() for t in tensors}
            if len(ptrs) != len(tensors):
                return False
        return True

    def _check_tensors(self, tensors: list[Any]) -> bool:
        """Each collected tensor against its recorded properties, in Python."""
        inc = torch._C._dispatch_tls_local_include_set()
        exc = torch._C._dispatch_tls_local_exclude_set()
        dispatch_keys = torch._C._dispatch_keys
        for t, (cls, dtype, requires_grad, size, stride, raw) in zip(
            tensors, self._tensor_checks, strict=True
        ):
            if not (
                type(t) is cls
                and t.dtype is dtype
                and t.is_cpu
                and t.requires_grad is requires_grad
                and t.size() == size
                and t.stride() == stride
                and ((dispatch_keys(t) | inc) - exc).raw_repr() == raw
            ):
                return False
        return True

    def _tensors_ok(self, tensors: list[Any]) -> bool:
        native = self._tensor_guards
        return (native is not None and native.check(*tensors)) or self._check_tensors(tensors)

    def _examples_with_recorded_keys(self) -> list[torch.Tensor] | None:
        """Empty tensors with the recorded properties, if under the current thread-local
        state they get the recorded dispatch keys (None otherwise)."""
        inc = torch._C._dispatch_tls_local_include_set()
        exc = torch._C._dispatch_tls_local_exclude_set()
        examples = []
        for cls, dtype, requires_grad, size, stride, raw in self._tensor_checks:
            t = torch.empty_strided(size, stride, dtype=dtype)  # untouched: no pages
            if cls is torch.nn.Parameter:
                t = torch.nn.Parameter(t, requires_grad=requires_grad)
            elif requires_grad:
                t.requires_grad_(True)
            if ((torch._C._dispatch_keys(t) | inc) - exc).raw_repr() != raw:
                return None
            examples.append(t)
        return examples

    def _native_tensor_guards(self, examples: list[torch.Tensor]) -> Any:
        """PyTorch's C++ ``TensorGuards`` over all collected tensors, or None.

        It checks the same properties as ``_check_tensors`` in one call (a
        fraction of a microsecond per tensor), and is also stricter: it fails
        when one tensor object appears twice (tied weights, the same input
        passed twice), in which case ``_check_tensors`` decides. Built from
        ``examples`` (which got the recorded keys), so under the same
        thread-local state both checks accept exactly the same tensors.
        """
        checks = self._tensor_checks
        if not checks:
            return None
        try:
            return torch._C._dynamo.guards.TensorGuards(  # type: ignore[attr-defined]
                *examples,
                dynamic_dims_sizes=[list(c[3]) for c in checks],
                dynamic_dims_strides=[list(c[4]) for c in checks],
            )
        except Exception as exc:  # another PyTorch's signature: the Python check decides
            logging.getLogger("torch_precompile").debug("no native tensor guards: %s", exc)
            return None

    def _collect_alias_groups(self, node: dict[str, Any]) -> None:
        for leaf in node["leaves"]:
            if leaf[0] == "no_aliasing" and leaf[1] not in self._alias_groups:
                self._alias_groups.append(leaf[1])
        subs = [child for _, child in node["children"]]
        for _, k, v in (node.get("dict") or {}).get("entries", []):
            subs.extend(x for x in (k, v) if x is not None)
        for sub in subs:
            self._collect_alias_groups(sub)

    def _const(self, value: Any) -> str:
        name = f"k{len(self._consts)}"
        self._consts[name] = value
        return name

    def _var(self) -> str:
        self._n += 1
        return f"v{self._n}"

    def _fail_unless(self, cond: str) -> None:
        self._lines.append(f"    if not ({cond}): return False")

    def _emit_node(self, node: dict[str, Any], var: str, _depth: int) -> None:
        if node["source"] in self._alias_sources:
            self._lines.append(f"    seen[{self._const(node['source'])}] = {var}")
        for leaf in node["leaves"]:
            self._emit_leaf(leaf, var)
        d = node.get("dict")
        if d is not None:
            self._fail_unless(f"type({var}) is dict and len({var}) == {int(d['size'])}")
            keys, values = self._var(), self._var()
            self._lines.append(f"    {keys} = list({var}); {values} = list({var}.values())")
            for i, k, v in d["entries"]:
                for sub, seq in ((k, keys), (v, values)):
                    if sub is not None:
                        item = self._var()
                        self._lines.append(f"    {item} = {seq}[{int(i)}]")
                        self._emit_node(sub, item, _depth + 1)
        for step, child in node["children"]:
            item = self._var()
            if step[0] == "vars":
                self._lines.append(f"    {item} = {var}.__dict__")
            else:
                self._lines.append(f"    {item} = {var}[{self._const(step[1])}]")
            self._emit_node(child, item, _depth + 1)

    def _emit_leaf(self, leaf: list[Any], v: str) -> None:
        kind = leaf[0]
        if kind == "tensor":
            _, cls, keys_text, dtype_name, requires_grad, size, stride = leaf
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name}")
            self._tensor_checks.append(
                (
                    torch.nn.Parameter if cls == "Parameter" else torch.Tensor,
                    dtype,
                    bool(requires_grad),
                    tuple(int(n) for n in size),
                    tuple(int(n) for n in stride),
                    _dispatch_key_set_raw(keys_text),
                )
            )
            self._lines.append(f"    T.append({v})")
        elif kind == "no_dynamic_marking":
            attrs = frozenset(leaf[1])
            if any(hasattr(torch.Tensor, a) or hasattr(torch.nn.Parameter, a) for a in attrs):
                raise ValueError("tensor classes define a dynamic-marking attribute")
            # Plain tensors and parameters define none of these: only the instance
            # dict can hold them (cheaper than hasattr); anything else uses hasattr.
            a, plain = self._const(attrs), self._const((torch.Tensor, torch.nn.Parameter))
            self._fail_unless(
                f"{a}.isdisjoint({v}.__dict__) if type({v}) in {plain} "
                f"else not any(hasattr({v}, x) for x in {a})"
            )
        elif kind == "no_aliasing":
            pass  # checked once every value is known
        elif kind == "type":
            self._fail_unless(f"type({v}) is {self._const(_LIGHT_TYPES[leaf[1]])}")
        elif kind == "equals":
            expected = self._const(leaf[1])
            self._fail_unless(f"type({v}) is {self._const(type(leaf[1]))} and {v} == {expected}")
        elif kind == "is":
            self._fail_unless(f"{v} is {self._const(leaf[1])}")
        elif kind == "len":
            self._fail_unless(f"len({v}) == {int(leaf[1])}")
        elif kind == "contains":
            self._fail_unless(f"({self._const(leaf[1])} in {v}) is {bool(leaf[2])}")
        elif kind == "global_state":
            guard = torch._C._dynamo.guards.GlobalStateGuard()  # type: ignore[attr-defined]
            guard.__setstate__(leaf[1])
            self._fail_unless(f"{self._const(guard)}.check()")
        elif kind == "no_torch_function_mode":
            self._fail_unless("tf_stack_len() == 0")
        elif kind == "no_default_device":
            self._fail_unless("utils_device.CURRENT_DEVICE is None")
        elif kind == "no_saved_tensor_hooks":
            self._fail_unless("top_hooks(True) is None")
        else:
            raise ValueError(f"unknown light guard {kind!r}")


def _dispatch_key_set_raw(text: str) -> int:
    """The raw bits of a DispatchKeySet from its repr, checked to round-trip."""
    names = [n.strip() for n in text[len("DispatchKeySet(") : -1].split(",") if n.strip()]
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for name in names:
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    if repr(keys) != text:
        raise ValueError(f"cannot rebuild {text}")
    return keys.raw_repr()


class TieredGuardManager:
    """Light guards first; Dynamo's guard manager, built on first need, decides the rest."""

    def __init__(self, light: LightGuards | None, build_full: Callable[[], Any]) -> None:
        self.light = light
        self._build_full = build_full
        self._full: Any = None

    @property
    def full(self) -> Any:
        if self._full is None:
            self._full = self._build_full()
        return self._full

    def check(self, f_locals: dict[str, Any]) -> bool:
        if self.light is not None and self.light.check(f_locals):
            return True
        return bool(self.full.check(f_locals))

    def check_verbose(self, f_locals: dict[str, Any]) -> Any:
        return self.full.check_verbose(f_locals)


def _load_guard_manager(
    guards_state: bytes, original_code: types.CodeType, f_globals: dict[str, Any]
) -> Any:
    """Dynamo's guard manager from its saved state (imports torch._dynamo, not the compilers)."""
    from torch._dynamo import convert_frame
    from torch._dynamo.package import load_guard_manager, load_guards_state
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, compile_context

    with (
        compile_context(CompileContext(convert_frame.get_compile_id({}))),
        get_metrics_context(),
    ):
        return load_guard_manager(load_guards_state(guards_state), original_code, f_globals)
