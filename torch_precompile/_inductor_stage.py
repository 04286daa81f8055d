"""Stage 3: Inductor partitions (for training) and compiles the graphs to kernels."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import _capture_registry, _compat, _system
from ._aot_stage import AOTAutogradOutput, check_calling_convention, resolve_capture
from ._dynamo_stage import CaptureState, stage_timings
from ._guards import Guard, Guards
from ._index_bounds import index_guards

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass(frozen=True)
class InductorOutput:
    """Compiled forward (and backward) code; unpacks to ``(compiled, guards)``."""

    compiled: Any
    guards: Guards
    source_code: dict[str, str]
    training: bool
    _state: CaptureState = dataclasses.field(repr=False, compare=False)
    _timings: Mapping[str, float] = dataclasses.field(repr=False, compare=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.compiled, self.guards))

    def as_text(self) -> str:
        """The Python/C++ code Inductor generated for each graph."""
        parts = []
        for name, code in self.source_code.items():
            parts.append(f"# ===== Inductor {name} =====\n{code.strip()}")
        return "\n\n".join(parts) if parts else "# (Inductor kept no source code)"


def inductor(
    joint_or_aot_output: torch.fx.GraphModule | AOTAutogradOutput,
    guards: Guards | None = None,
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> InductorOutput:
    """Compile the AOTAutograd graph with Inductor (``mode``/``options`` as in torch.compile)."""
    if isinstance(joint_or_aot_output, AOTAutogradOutput):
        aot = joint_or_aot_output
        joint_gm = aot.joint_graph
        guards = guards or aot.guards
    else:
        joint_gm = joint_or_aot_output
        if not isinstance(joint_gm, torch.fx.GraphModule):
            raise TypeError(
                "expected an AOTAutogradOutput or torch.fx.GraphModule, "
                f"got {type(joint_gm).__name__}"
            )
        resolve_capture(joint_gm, guards, "this joint graph")
        found = _capture_registry.output_of(AOTAutogradOutput, joint_gm, guards)
        if found is None:
            raise ValueError(
                "this graph was not produced by Precompile.aot_autograd; run that stage first, "
                "and pass its output, or the joint graph and the guards it returned"
            )
        aot = found
        guards = guards if guards is not None else aot.guards
    state = aot._state
    jd = aot._joint
    if joint_gm is not _compat.joint_graph_module(jd):
        check_calling_convention(joint_gm, _compat.joint_placeholder_count(jd), None, "inductor")
    capture = state.capture
    shape_before = len(_compat.shape_env_guard_exprs(capture))
    log.info("inductor: compiling %s", "forward and backward" if aot.training else "forward")
    start = time.perf_counter()
    # The compile works on private copies: ``aot`` can compile again (another config).
    with torch.set_grad_enabled(state.grad_enabled):
        compiled, sources = _compat.compile_joint(
            capture, jd, joint_gm, aot._dynamo_graph, mode, options
        )
    elapsed = time.perf_counter() - start
    log.info("inductor: done in %.2f s", elapsed)
    added = [
        Guard("inductor", "shape", expr, None, expr)
        for expr in _compat.shape_env_guard_exprs(capture)[shape_before:]
    ]
    added.extend(index_guards(joint_gm, capture.input_sources))
    added.extend(system_guards(capture.device_type))
    timings = stage_timings(aot._timings, "inductor", elapsed)
    out = InductorOutput(compiled, guards.extend(added), sources, aot.training, state, timings)
    compiled._torch_precompile_output = out
    return out


def system_guards(device_type: str) -> list[Guard]:
    """What the generated kernels assume about the machine; checked at load."""
    info = _system.current_system()
    entries = [
        Guard("inductor", "system", f"device type == {device_type}", "device_type", device_type),
        Guard("inductor", "system", f"torch version == {info['torch']}", "torch", info["torch"]),
        Guard("inductor", "system", f"python == {info['python']}", "python", info["python"]),
    ]
    if device_type == "cpu":
        entries.append(
            Guard(
                "inductor",
                "system",
                f"CPU instruction set >= {info['cpu_isa']}",
                "cpu_isa",
                info["cpu_isa"],
            )
        )
    elif info.get("cuda"):
        cap = info["cuda"]["capability"]
        entries.append(
            Guard("inductor", "system", f"CUDA compute capability == {cap}", "cuda_capability", cap)
        )
    return entries
