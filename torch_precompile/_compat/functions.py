"""PyTorch's ``AOTCompiledFunction``: guards, assembly, (de)serialization, accessors."""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import pickle
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import fastload
from .capture import Capture
from .light_guards import hook_guards_enabled


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
def _guard_state_pickled_portably() -> Iterator[None]:
    """Pickle Dynamo's guard state so that it rebuilds in a process without the model.

    - nn.Modules become plain ``nn.Module`` objects: PyTorch pickles a
      module-level class by reference, so loading would need the model's class
      to be importable. Guards on module *types* are dropped by our filter, so
      a plain module with the same attributes rebuilds the same guard tree.
      Its state is ``nn.Module``'s (the instance ``__dict__``), whatever
      ``__getstate__`` its class defines: the guards read the instance's
      attributes, as on the stand-in, and a class's own pickling rules are for
      pickling the model (a module with a parametrization, such as
      ``weight_norm``, refuses to be pickled at all).
    - A function pickle cannot find by qualified name (the undecorated
      function a ``functools.wraps`` decorator keeps in its closure) is saved
      by value. PyTorch would save a ``_Missing`` placeholder, and the guards
      kept on it (its ``__defaults__``, say) would fail at load.
    """
    from torch._dynamo.guards import GuardsStatePickler

    original = GuardsStatePickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if (
            isinstance(obj, torch.nn.Module)
            and type(obj) is not torch.nn.Module
            and id(obj) in self.guard_tree_values
            and not isinstance(obj, torch.nn.parallel.DistributedDataParallel)
        ):
            original(self, obj)  # records missing values as a side effect
            return GuardsStatePickler._unpickle_module, (torch.nn.Module.__getstate__(obj),)
        if (
            inspect.isfunction(obj)
            and id(obj) not in self.missing_values
            and "<locals>" not in obj.__qualname__
            and not findable_by_name(obj)
        ):
            return _function_by_value(obj)
        return original(self, obj)

    with _reducer_override_patched(GuardsStatePickler, reducer_override):
        yield


def guard_filter_entry_fields(entry: Any) -> tuple[str, str, bool, Any]:
    """(name, guard_type, is_global, value) of a Dynamo GuardFilterEntry.

    ``is_global``: the source is rooted in the capturing process's globals, as
    Dynamo's own flag says, or in a module it reached by import, which Dynamo's
    flag leaves out (see :func:`_rooted_in_process_globals`).
    """
    orig = getattr(entry, "orig_guard", None)
    source = getattr(orig, "originating_source", None)
    is_global = entry.is_global or (source is not None and _rooted_in_process_globals(source))
    return entry.name, entry.guard_type, is_global, entry.value


def _rooted_in_process_globals(source: Any) -> bool:
    """Whether a Dynamo source reads the process's state rather than the call's inputs:
    a global of the traced code's module, or a module Dynamo imports itself
    (``__import__('torch').utils._pytree.SUPPORTED_NODES``, a registry that
    libraries fill as they are imported, guarded when traced code uses pytree).

    Dynamo rebuilds an import-rooted source only inside a trace, so such a
    source in the saved guard state would also fail to load.
    """
    from torch._dynamo.source import ChainedSource, ImportSource, get_global_source_name

    if get_global_source_name(source) is not None:
        return True
    while isinstance(source, ChainedSource):
        source = source.base
    return isinstance(source, ImportSource)


def guard_filter_entry_derived_kinds(entry: Any) -> tuple[str, ...]:
    """The guard kinds a Dynamo GuardFilterEntry is built on (BUILTIN_MATCH -> ID_MATCH)."""
    return tuple(getattr(entry, "derived_guard_types", ()) or ())


def guard_filter_entry_source(entry: Any) -> str:
    """The full source of a GuardFilterEntry (``L['x']``; its ``name`` drops the ``L[...]``)."""
    orig = getattr(entry, "orig_guard", None)
    return getattr(orig, "name", None) or entry.name


def _pruning_key_order_sources(
    output_graph: Any,
    guard_filter: Callable[[Sequence[Any]], Sequence[bool]],
    keep_source: Callable[[str, bool], bool],
) -> Callable[[Sequence[Any]], list[bool]]:
    """Wrap ``guard_filter`` so that dict key order is guarded only where guards are kept.

    Dynamo evaluates every ``guard_on_key_order`` source each time it builds a
    guard manager, and again at load. The key order of a library's global
    registry (filled as its models are built) differs in another process, and
    the guards on it are dropped by our filter: evaluating its source at load
    would fail on something the artifact does not check. Dynamo calls the
    filter between its unfiltered and its filtered build; from then on (the
    in-process manager and the saved state alike) only sources that
    ``keep_source`` accepts and some kept guard reads are key-order guarded.
    """

    def wrapped(entries: Sequence[Any]) -> list[bool]:
        keep = list(guard_filter(entries))
        kept_names = [guard_filter_entry_source(e) for e, k in zip(entries, keep) if k]
        output_graph.guard_on_key_order = {
            source
            for source in output_graph.guard_on_key_order
            if keep_source(source.name, _rooted_in_process_globals(source))
            and any(source.name in name for name in kept_names)
        }
        return keep

    return wrapped


def build_guard_manager(
    capture: Capture,
    guard_filter: Callable[[Sequence[Any]], Sequence[bool]],
    keep_source: Callable[[str, bool], bool],
) -> tuple[Any, bytes]:
    """Build Dynamo's guard manager after compilation (so shape guards added by
    AOTAutograd and Inductor are included) and its serialized state.

    ``keep_source(name, is_global)`` says whether guards on a source are saved;
    sources Dynamo evaluates for dict key order are pruned with it.
    """
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._dynamo.variables.torch_function import (
        torch_function_mode_stack_state_mgr,
    )

    output_graph = capture.graph_capture_output.output_graph
    key_order = output_graph.guard_on_key_order
    hooks = Hooks(
        guard_filter_fn=_pruning_key_order_sources(output_graph, guard_filter, keep_source)
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_metrics_context())
        stack.enter_context(dynamo_timed("torch_precompile.build_guards"))
        if torch_function_mode_stack_state_mgr.stack:
            stack.enter_context(torch_function_mode_stack_state_mgr.temp_restore_stack())
        stack.enter_context(_guard_state_pickled_portably())
        stack.enter_context(hook_guards_enabled())
        # Dynamo checks the new guards against the current global state: restore the
        # capture's grad mode, so precompile() may run outside the capture's no_grad block.
        stack.enter_context(torch.set_grad_enabled(capture.grad_enabled))
        # A stage output is a value: the capture's key-order set is put back.
        stack.callback(setattr, output_graph, "guard_on_key_order", key_order)
        check_fn = capture.graph_capture_output.build_guards(
            capture.traced_fn.__code__, hooks=hooks, save=True, strict_error=True
        )
    if check_fn.guards_state is None:
        raise RuntimeError("Dynamo produced no serializable guard state")
    return check_fn.guard_manager, check_fn.guards_state


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


def findable_by_name(fn: types.FunctionType) -> bool:
    """Whether pickle can find ``fn`` by module and qualified name (it is that object)."""

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


def _function_by_value(fn: types.FunctionType) -> tuple[Any, tuple[Any, ...]]:
    """A pickle reduction that rebuilds ``fn`` from its code, not its name."""
    return _rebuild_function, (
        fn.__code__,
        fn.__module__,
        fn.__name__,
        fn.__qualname__,
        fn.__defaults__,
        fn.__kwdefaults__,
        fn.__closure__,
        dict(fn.__dict__),
    )


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
            return _function_by_value(obj)
        return original(self, obj)

    with _reducer_override_patched(AOTCompilePickler, reducer_override):
        yield


def serialize_compiled_function(fn: Any) -> bytes:
    """PyTorch's own AOTCompiledFunction serialization (unfindable functions by value)."""
    if isinstance(fn, fastload.FastCompiledFunction):
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
