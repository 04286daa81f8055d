"""Stage 4: bundle the compiled code, guards and weights into a callable artifact."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from . import _compat, _output_structure, _system
from ._artifact import PrecompiledArtifact, variant_label
from ._handoff import take_over
from ._inductor_stage import InductorOutput
from ._output_layout import stride_orders
from ._runtime import Runtime, VariantRuntime
from ._signature import describe_graph_outputs
from .guards import (
    Guard,
    dropped_guard,
    range_guards,
    serializable_guard_filter,
    source_is_rechecked,
)

log = logging.getLogger("torch_precompile")


def bundle_variants(variants: Sequence[PrecompiledArtifact]) -> PrecompiledArtifact:
    """One artifact over several compiled variants of one model; a call runs the
    first variant whose guards hold (order is priority: put fast paths first)."""
    # A bundle among the variants (a dynamic compile with its size-1 variants) is
    # spread out: one flat list, each variant loading on its own path.
    variants = tuple(v for a in variants for v in (a.variants or (a,)))
    if not variants:
        raise ValueError("precompile() got an empty list; pass at least one variant")
    if len({id(v.module) for v in variants}) != 1:
        raise ValueError(
            "the variants bind different models; variants of one artifact must be captured from "
            "the same model object (they share its weights)"
        )
    first = variants[0]
    runtime = VariantRuntime(variants, [variant_label(v) for v in variants])
    return dataclasses.replace(
        first,
        training=any(v.training for v in variants),
        timings={k: sum(v.timings.get(k, 0.0) for v in variants) for k in first.timings},
        _runtime=runtime,  # type: ignore[arg-type]
        variants=variants,
    )


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
    state = handoff.state
    capture = state.capture
    log.info("precompile: building guards and the compiled function")
    start = time.perf_counter()
    dropped: list[str] = []
    translated: list[Guard] = []
    scope_module = getattr(capture.traced_fn, "__module__", None)
    closure_names = capture.traced_fn.__code__.co_freevars
    guard_filter = serializable_guard_filter(dropped, translated, scope_module, closure_names)
    guard_manager, guards_state = _compat.build_guard_manager(
        capture, guard_filter, source_is_rechecked
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
    signature = {
        **state.input_signature,
        "outputs": describe_graph_outputs(capture.graph_module),
        # Where each graph input comes from (L['x'], L['self']._modules[...]...), for
        # views and to_python after load.
        "graph_inputs": list(capture.input_sources),
        # Every input dimension each size symbol stands for (variants at size 1 use it).
        "symbol_sources": _compat.shape_env_symbol_all_sources(capture),
    }
    recording = _output_structure.record(
        compiled_function,
        capture.graph_module,
        capture.bound_self,
        state.args,
        state.kwargs,
        capture.input_sources,
        state.grad_enabled,
    )
    signature["output_structure"] = recording.structure
    # Eager's layout of each output, so that state returned by one call fits the next.
    signature["output_layouts"] = stride_orders(
        _output_structure.graph_output_values(capture.graph_module)
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
        globals_module=capture.traced_fn.__module__ or "",
        _recording=recording,
    )
