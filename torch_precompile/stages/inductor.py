"""Stage 3: Inductor partitions (for training) and compiles the graphs to kernels."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from .. import _compat, lean_writer
from ..guards import Guard, Guards, SystemGuard, shape_guards
from ..runtime import machine as _system
from .aot_autograd import AOTAutogradOutput
from .handoff import CompiledGraphs, Handoff, hand_out, stage_timings, take_over
from .index_bounds import index_guards

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass(frozen=True)
class InductorOutput:
    """Compiled forward (and backward) code; unpacks to ``(compiled, guards)``."""

    compiled: CompiledGraphs
    guards: Guards
    source_code: dict[str, str]
    training: bool
    _handoff: Handoff = dataclasses.field(repr=False, compare=False)

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
    aot, joint_gm, guards = take_over(
        joint_or_aot_output, guards, AOTAutogradOutput, "aot_autograd", "inductor"
    )
    return compile_graphs(aot, joint_gm, guards, mode, options)


def compile_graphs(
    aot: Handoff,
    joint_gm: torch.fx.GraphModule,
    guards: Guards,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> InductorOutput:
    """The stage's work on AOTAutograd's handoff, its graph and guards: what
    :func:`inductor` runs once it has taken over."""
    state = aot.state
    jd = aot.joint
    capture = state.capture
    log.info("inductor: compiling %s", "forward and backward" if aot.training else "forward")
    start = time.perf_counter()
    # The compile works on private copies: ``aot`` can compile again (another config).
    with torch.set_grad_enabled(state.grad_enabled):
        compiled, sources = _compat.compile_joint(
            capture, jd, joint_gm, aot.dynamo_graph, mode, options
        )
        # Ours from here on: a save never looks in Inductor's cache, which may be gone.
        kernels = lean_writer.kept_kernels(sources.values())
    elapsed = time.perf_counter() - start
    log.info("inductor: done in %.2f s", elapsed)
    added = shape_guards("inductor", _compat.shape_env_guard_exprs(capture), guards)
    added.extend(index_guards(joint_gm, capture.input_sources))
    added.extend(system_guards(capture.device_type))
    handoff = Handoff(
        "inductor",
        state,
        guards.extend(added),
        stage_timings(aot.timings, "inductor", elapsed),
        aot.training,
    )
    return InductorOutput(
        CompiledGraphs(compiled, handoff, kernels),
        hand_out(handoff),
        sources,
        aot.training,
        handoff,
    )


def system_guards(device_type: str) -> list[Guard]:
    """What the generated kernels assume about the machine; checked at load."""
    info = _system.current_system()
    facts = [
        ("device_type", f"device type == {device_type}", device_type),
        ("torch", f"torch version == {info['torch']}", info["torch"]),
        ("python", f"python == {info['python']}", info["python"]),
    ]
    if device_type == "cpu":
        facts.append(("cpu_isa", f"CPU instruction set >= {info['cpu_isa']}", info["cpu_isa"]))
    elif info.get("cuda"):
        cap = info["cuda"]["capability"]
        facts.append(("cuda_capability", f"CUDA compute capability == {cap}", cap))
    return [SystemGuard("inductor", expr, key, _frozen(value)) for key, expr, value in facts]


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
