"""Stage 4: bundle the compiled code, guards and weights into a callable artifact."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from .. import _compat, lean_writer
from ..guards import (
    Guard,
    dropped_guard,
    range_guards,
    serializable_guard_filter,
    source_is_rechecked,
)
from ..runtime import machine as _system
from ..runtime.artifact import PrecompiledArtifact
from ..runtime.bundle import bundle_variants
from ..runtime.call import Runtime
from ..runtime.signature import describe_graph_outputs
from . import output_structure as _output_structure
from .handoff import CompiledGraphs, Handoff, take_over
from .inductor import InductorOutput

log = logging.getLogger("torch_precompile")


def precompile(compiled_or_inductor_output: Any) -> PrecompiledArtifact:
    """Bundle Inductor's output, Dynamo's bytecode and the final guards into an artifact.

    Given a list (of Inductor outputs or artifacts), returns one artifact
    holding each as a variant; see :func:`bundle_variants`.
    """
    if isinstance(compiled_or_inductor_output, (list, tuple)):
        return bundle_variants(
            [
                v if isinstance(v, PrecompiledArtifact) else precompile(v)
                for v in compiled_or_inductor_output
            ]
        )
    handoff, compiled, _ = take_over(
        compiled_or_inductor_output, None, InductorOutput, "inductor", "precompile"
    )
    return make_artifact(handoff, compiled)


def make_artifact(handoff: Handoff, compiled: CompiledGraphs) -> PrecompiledArtifact:
    """The stage's work on Inductor's handoff and compiled code: what :func:`precompile`
    runs once it has taken over."""
    state = handoff.state
    capture = state.capture
    log.info("precompile: building guards and the compiled function")
    start = time.perf_counter()
    dropped: list[str] = []
    translated: list[Guard] = []
    scope_module = getattr(capture.traced_fn, "__module__", None)
    closure_names = capture.traced_fn.__code__.co_freevars
    guard_filter = serializable_guard_filter(dropped, translated, scope_module, closure_names)
    guard_manager, guards_state, lean_guards = _compat.build_guard_manager(
        capture, guard_filter, source_is_rechecked, lean_writer.read_lean_guards
    )
    compiled_function = _compat.make_compiled_function(
        capture, compiled.fn, guard_manager, guards_state
    )
    elapsed = time.perf_counter() - start
    log.info("precompile: done in %.2f s", elapsed)
    # Ranges read after Inductor, so bounds added while lowering are included.
    ranges = range_guards(
        _compat.shape_env_var_ranges(capture),
        _compat.shape_env_symbol_sources(capture),
        capture.size_oblivious,
    )
    guards = handoff.guards.extend([*translated, *ranges])
    if dropped:
        guards = guards.extend([dropped_guard(dropped)])
    recording = _output_structure.record(
        compiled_function,
        capture.graph_module,
        capture.bound_self,
        state.args,
        state.kwargs,
        capture.input_sources,
        state.grad_enabled,
    )
    signature = dataclasses.replace(
        state.input_signature,
        outputs=describe_graph_outputs(capture.graph_module),
        # For views and to_python after load.
        graph_inputs=list(capture.input_sources),
        symbol_sources=_compat.shape_env_symbol_all_sources(capture),
        output_structure=recording.structure,
        # Eager's layout of each output, so that state returned by one call fits the next.
        output_layouts=recording.layouts,
    )
    runtime = Runtime(
        compiled_function,
        guards,
        capture.bound_self,
        handoff.training,
        state.grad_enabled,
        signature,
    )
    return PrecompiledArtifact(
        guards=guards,
        signature=signature,
        system=_system.current_system(),
        training=handoff.training,
        device_type=capture.device_type,
        timings={**handoff.timings, "precompile": elapsed},
        bytecode=capture.graph_capture_output.bytecode,
        compiled_function=compiled_function,
        _runtime=runtime,
        kernels=compiled.kernels,
        lean_guards=lean_guards,
        globals_module=capture.traced_fn.__module__ or "",
        _recording=recording,
    )
