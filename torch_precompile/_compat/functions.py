"""PyTorch's ``AOTCompiledFunction``: guards, assembly, (de)serialization, accessors."""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import pickle
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._stable import today
from ..lean import LeanCompiledFunction, hook_guards_enabled
from ..lean.pickling import (
    findable_by_name,
    function_by_value,
    reducer_override_patched,
)
from .capture import Capture
from .distributed import full_path_meshes


def _picklable_items(mapping: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``mapping`` that pickle (a builtins dict holds a few that do not)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        try:
            pickle.dumps(value)
        except Exception:  # pickle raises many types (TypeError, PicklingError, ...)
            continue
        out[key] = value
    return out


def runtime_env_with_builtins(gco: Any) -> Any:
    """Dynamo's ``GraphRuntimeEnv`` with the builtins its bytecode reads in ``used_globals``.

    ``AOTCompiledFunction`` refuses to build (in the saving process and at load)
    unless every name the bytecode loads with ``LOAD_GLOBAL`` is in its globals.
    Dynamo's bytecode can read builtins that way (``type`` in the code that
    rebuilds a transformers model's output, a ``__builtins_dict___N`` copy of
    the builtins), and torch 2.11's ``get_runtime_env`` saves only the globals
    that graph inputs come from: ``Missing required external references:
    ['type']``. torch 2.12 added those builtins itself (pytorch/pytorch#177558);
    on it this adds nothing.
    """
    env = gco.get_runtime_env()
    f_globals = gco.f_globals
    for ref in env.external_refs:
        if ref in env.used_globals:
            continue
        if ref.startswith("__builtins_dict__") and isinstance(f_globals.get(ref), dict):
            env.used_globals[ref] = _picklable_items(f_globals[ref])
        elif ref not in f_globals and hasattr(builtins, ref):  # a module global shadows it
            env.used_globals[ref] = getattr(builtins, ref)
    return env


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
        runtime_env=runtime_env_with_builtins(gco),
        source_info=source_info,
        device_type=capture.device_type,
        backend_name="inductor",
    )
    return AOTCompiledFunction(_artifacts=artifacts, _extra_globals=capture.traced_fn.__globals__)


def serialize_compiled_function(fn: Any) -> bytes:
    """PyTorch's own AOTCompiledFunction serialization (unfindable functions by value)."""
    if isinstance(fn, LeanCompiledFunction):
        return fn.serialized  # loaded by the lean path: the bytes it was loaded from
    from torch._dynamo.aot_compile import AOTCompiledFunction

    with functions_pickled_by_value():
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

    out: dict[str, Any] = {}
    for name, (module, qualname) in refs.items():
        try:
            obj: Any = importlib.import_module(today(module))
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
    data: bytes,
    f_globals: dict[str, Any] | None = None,
    *,
    cudagraphs: bool = False,
    hook_guards: bool = False,
) -> Any:
    """Inverse of :func:`serialize_compiled_function`.

    ``cudagraphs``: the artifact was compiled with ``mode="reduce-overhead"``.
    PyTorch's bundled AOTAutograd entry decides whether to wrap the graphs in
    CUDA graphs from ``config.triton.cudagraphs`` *at deserialization*, so we
    set it for the duration of the call.

    ``hook_guards``: the guards were built under :func:`hook_guards_enabled`
    (every artifact saved since; older files saved the hook dicts as missing
    values, so their guard manager is rebuilt without those checks).
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
        if hook_guards:
            stack.enter_context(hook_guards_enabled())  # the guard manager is rebuilt here
        stack.enter_context(full_path_meshes())  # a DeviceMesh constant: this rank's
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


def compiled_function_import_sources(fn: Any) -> dict[str, str]:
    """The modules Dynamo's bytecode names as globals, ``{alias: module}``."""
    return dict(fn._artifacts.runtime_env.import_sources or {})


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
def stubbed_compiled_graph(fn: Any, outputs: list[Any]) -> Iterator[list[tuple[Any, ...]]]:
    """Run an AOTCompiledFunction's bytecode with its compiled graph replaced by a stub
    that returns ``outputs`` (no kernel runs); yields the flat inputs of each call."""
    f_globals = fn.fn.__globals__
    key = fn._artifacts.backend_id
    original = f_globals[key]
    calls: list[tuple[Any, ...]] = []

    def stub(*args: Any) -> Any:
        calls.append(args)
        return list(outputs)

    f_globals[key] = stub
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


def global_state_unchanged() -> Callable[[], bool]:
    """A check that torch's global state is still what it is now, as Dynamo's guards
    read it: its ``GlobalStateGuard`` (grad mode, autocast, default dtype,
    deterministic algorithms, ...), the torch function modes, the default device and
    the saved-tensor hooks. A microsecond a call; imports no Dynamo."""
    from torch.utils import _device

    state = torch._C._dynamo.guards.GlobalStateGuard()  # type: ignore[attr-defined]
    modes = torch._C._len_torch_function_stack()
    device = _device.CURRENT_DEVICE
    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    hooks = top_hooks(True)

    def unchanged() -> bool:
        return (
            state.check()
            and torch._C._len_torch_function_stack() == modes
            and _device.CURRENT_DEVICE is device
            and top_hooks(True) == hooks
        )

    return unchanged


def concrete_zeros_like(example: Any) -> Any:
    """Zeros with ``example``'s dtype and device at its example sizes (a fake tensor's
    symbolic sizes read by their hints); non-tensors are returned as they are."""
    if not isinstance(example, torch.Tensor):
        return example
    sizes = [size_hint(s) or 0 for s in example.shape]
    return torch.zeros(sizes, dtype=example.dtype, device=example.device)


def size_hint(value: Any) -> int | None:
    """An int, or a symbolic size's example value (its hint); None when it has none."""
    node = getattr(value, "node", None)
    if node is None:
        return int(value)
    return int(node.hint) if node.hint is not None else None


def linear_in_sizes(value: Any) -> tuple[dict[str, int], int] | None:
    """An int or symbolic size as ``({symbol: coefficient}, constant)``; None when it is
    not a sum of integer multiples of size symbols (``s0 + s1 - 1``: ``({s0: 1, s1: 1}, -1)``)."""
    node = getattr(value, "node", None)
    if node is None:
        return ({}, int(value)) if isinstance(value, int) else None
    terms: dict[str, int] = {}
    const = 0
    for term, coeff in node.expr.as_coefficients_dict().items():
        if not coeff.is_Integer:
            return None
        if term == 1:
            const = int(coeff)
        elif term.is_Symbol:
            terms[str(term)] = int(coeff)
        else:
            return None
    return terms, const


def wrap_compiled_graph(fn: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace the compiled graph an AOTCompiledFunction's bytecode calls by ``wrap(graph)``."""
    f_globals = fn.fn.__globals__
    key = fn._artifacts.backend_id
    f_globals[key] = wrap(f_globals[key])


@contextlib.contextmanager
def functions_pickled_by_value() -> Iterator[None]:
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
            return function_by_value(obj)
        return original(self, obj)

    with reducer_override_patched(AOTCompilePickler, reducer_override):
        yield
