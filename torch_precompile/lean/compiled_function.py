"""Lean load: shipped kernels, no compiler, no Inductor, no Dynamo, no Triton.

Runs what ``lean_writer/lean_sections.py`` wrote at save (:func:`lean_sections`): the
shipped kernels (one section each) and the ``lean`` section (Inductor's wrapper,
Dynamo's bytecode, its globals, the signature and the guard state).

Loading writes the shared objects into a private directory, ``dlopen``\\ s them
and executes the wrapper with light stand-ins for the few Inductor names it
imports (:mod:`.wrapper`). No C++ compiler runs, ``TORCHINDUCTOR_CACHE_DIR`` is
not read, and neither ``torch._inductor``'s compiler nor AOTAutograd is
imported. Guards are checked by a plain-Python translation of Dynamo's guard
tree (:mod:`.guards`); Dynamo's own guard manager (which imports
``torch._dynamo``) is built only when that check fails or the tree could not be
translated. The saved code was checked at save time to be one of the cases
this runner handles: inference (:mod:`.inference`: input mutations kept in
the graph, outputs aliasing inputs; ``mode="reduce-overhead"`` recorded by
:mod:`.cudagraphs`) and training (:mod:`.autograd`), on CPU or CUDA,
static or dynamic shapes (Inductor's wrapper reads the sizes off its inputs).
Any other artifact, or any failure here, loads through PyTorch's full path.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import pickle
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..file import trace as _trace
from . import autograd as lean_autograd
from . import cudagraphs as lean_cudagraphs
from . import inference, wrapper
from . import subclasses as lean_subclasses
from .bytecode_globals import bytecode_function
from .dynamo_fallback import LeanGuardManager, load_dynamo_guard_manager
from .guards import LeanGuards
from .pickling import loads_code
from .schema import InferenceSpec, LeanSection

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass
class LeanCompiledFunction:
    """A compiled function loaded by the lean path (see the module docstring).

    Shaped like PyTorch's ``AOTCompiledFunction`` where the runtime reads it
    (``_artifacts.guard_manager``, ``.signature``, ``.runtime_env``,
    ``.device_type``; ``fn``), and keeps what it was loaded from so that saving
    it again writes the same sections: the ``lean`` bytes, the kernels and
    a reader of PyTorch's serialization (``compiled``), which this path never
    reads otherwise.
    """

    _artifacts: Any
    fn: Callable[..., Any]
    read_serialized: Callable[[], bytes]
    lean_section: bytes  # the ``lean`` section it was loaded from
    kernels: Mapping[str, bytes | memoryview]
    _extra_globals: dict[str, Any] | None = None  # the globals imported at load

    @property
    def serialized(self) -> bytes:
        """PyTorch's serialization of this function, as the file holds it (read now)."""
        return self.read_serialized()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.aot_compile import bind_locals

        f_locals = bind_locals(self._artifacts.signature, *args, **kwargs)
        if not self._artifacts.guard_manager.check(f_locals):
            raise RuntimeError("GuardManager check failed")
        return self.fn(*args, **kwargs)


def load_lean_compiled_function(
    section: bytes,
    kernels: Mapping[str, bytes | memoryview],
    read_serialized: Callable[[], bytes],
    filename: str,
    module_globals: dict[str, Any] | None = None,
) -> LeanCompiledFunction:
    """Rebuild a compiled function from its shipped kernels (no compiler, no Triton).

    ``read_serialized`` returns PyTorch's serialization of the function; it is
    called only if the function is saved again."""

    with _trace.phase("unpickle"):
        spec = LeanSection.read(pickle.loads(section))
    with _trace.phase("kernels"):
        graph_call = _graph_call(spec, kernels, filename)
    with _trace.phase("bytecode and its globals (imports their modules)"):
        fn = bytecode_function(spec, graph_call, module_globals)
    with _trace.phase("unpickle"):
        original_code = loads_code(spec.original_code)
        signature = pickle.loads(spec.signature)
    with _trace.phase("guards"):
        guard_manager = _guard_manager(spec, original_code, fn)
    runtime_env = types.SimpleNamespace(
        bytecode=fn.__code__,
        closure=fn.__closure__,
        import_sources=dict(spec.import_sources),
        used_globals=dict.fromkeys(spec.used_global_names),
        external_refs=set(spec.external_refs),
    )
    artifacts = types.SimpleNamespace(
        backend_id=spec.backend_id,
        compiled_fn=None,  # nothing of PyTorch's compiled callable is loaded
        guard_manager=guard_manager,
        signature=signature,
        runtime_env=runtime_env,
        device_type=spec.device_type,
        original_code=original_code,
    )
    return LeanCompiledFunction(artifacts, fn, read_serialized, section, kernels, module_globals)


def _graph_call(
    spec: LeanSection, kernels: Mapping[str, bytes | memoryview], filename: str
) -> Callable[..., Any]:
    """The compiled graph's call (forward, or the autograd pair), its kernels loaded."""
    guards_c = torch._C._dynamo.guards  # type: ignore[attr-defined]
    data_ptr = str(guards_c._torchinductor_pyobject_tensor_data_ptr)
    subclasses = spec.subclasses
    meshes = lean_subclasses.mesh_constants(subclasses) if subclasses is not None else None
    graph_call = wrapper.build_graph_call(
        spec.wrapper,
        spec.extern_kernels,
        spec.inputs_to_check,
        kernels,
        data_ptr,
        filename,
        spec.triton,
        spec.mutated_inputs,
        meshes,
        spec.pycode.wrapper,
    )
    backward = spec.backward
    if backward is not None:
        bw_call = wrapper.build_graph_call(
            backward.wrapper,
            spec.extern_kernels,
            backward.inputs_to_check,
            kernels,
            data_ptr,
            filename + " (backward)",
            spec.triton,
            (),
            meshes,
            spec.pycode.backward,
        )
        forward = graph_call.call_list
        wrap_gradients: Callable[[Any], tuple[Any, ...]] = tuple
        if subclasses is not None:  # DTensor inputs fed as their local shards
            forward = lean_subclasses.flattening(subclasses, forward)
            wrap_gradients = functools.partial(lean_subclasses.wrap_gradients, subclasses)
        graph_call = lean_autograd.make_autograd_call(
            backward.autograd, forward, bw_call.call_list, wrap_gradients
        )
    else:
        call_list = graph_call.call_list
        if spec.cudagraphs is not None:
            call_list = lean_cudagraphs.install(
                call_list, graph_call.apply_to_partitions, spec.cudagraphs
            )
        if subclasses is not None:  # DTensor inputs fed as their local shards
            call_list = lean_subclasses.flattening(subclasses, call_list)
        # No inference spec: a file that had none (the default).
        graph_call = inference.make_inference_call(spec.inference or InferenceSpec(), call_list)
    return graph_call


def _guard_manager(spec: LeanSection, original_code: Any, fn: Any) -> LeanGuardManager:
    """The lean guards, and Dynamo's guard manager built when they cannot decide."""
    light = None
    if spec.lean_guards is not None:
        try:
            light = LeanGuards(spec.lean_guards, spec.pycode.guards, spec.pycode.prepared)
        except Exception as exc:
            log.debug("lean guards unavailable: %s", exc)
    guard_manager = LeanGuardManager(
        light,
        functools.partial(
            # Built on first need, in the load's context (dict configs as stand-ins).
            contextvars.copy_context().run,
            load_dynamo_guard_manager,
            spec.guards_state,
            original_code,
            fn.__globals__,
            spec.hook_guards,
        ),
    )
    if light is None:
        guard_manager.full  # noqa: B018 - build now, so that a failure falls back at load
    return guard_manager
