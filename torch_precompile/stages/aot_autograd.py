"""Stage 2: AOTAutograd traces the joint forward+backward (or inference) ATen graph."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _compat
from ..distributed.tracing import one_rank_tracing
from ..guards import AutogradGuard, Guards, requires_grad_note, shape_guards
from .dynamo import DynamoOutput
from .handoff import Handoff, hand_out, stage_timings, take_over

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass(frozen=True)
class AOTAutogradOutput:
    """The joint (training) or inference ATen graph; unpacks to ``(joint_graph, guards)``."""

    joint_graph: torch.fx.GraphModule
    guards: Guards
    _handoff: Handoff = dataclasses.field(repr=False, compare=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.joint_graph, self.guards))

    @property
    def training(self) -> bool:
        """True for a joint forward+backward graph, False for an inference graph."""
        return self._handoff.training

    def as_text(self) -> str:
        """The joint (or inference) ATen graph as Python code."""
        kind = "joint forward+backward" if self.training else "inference"
        return f"# AOTAutograd {kind} graph\n" + self.joint_graph.code.strip()


def aot_autograd(
    gm_or_dynamo_output: torch.fx.GraphModule | DynamoOutput,
    guards: Guards | None = None,
    *,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> AOTAutogradOutput:
    """Trace the ATen graph of a Dynamo graph once, with AOTAutograd."""
    dynamo, gm, guards = take_over(
        gm_or_dynamo_output, guards, DynamoOutput, "dynamo", "aot_autograd"
    )
    return trace_joint(dynamo, gm, guards, decompositions)


def trace_joint(
    dynamo: Handoff,
    gm: torch.fx.GraphModule,
    guards: Guards,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> AOTAutogradOutput:
    """The stage's work on Dynamo's handoff, its graph (or one that keeps its calling
    convention) and guards: what :func:`aot_autograd` runs once it has taken over."""
    state = dynamo.state
    capture = state.capture
    log.info("aot_autograd: tracing the ATen graph")
    start = time.perf_counter()
    # Later stages run under the capture's grad mode: it decides training vs inference.
    with torch.set_grad_enabled(state.grad_enabled), one_rank_tracing(state.one_rank):
        jd = _compat.export_joint(capture, gm, decompositions)
    elapsed = time.perf_counter() - start
    training = _compat.joint_needs_autograd(jd)
    log.info(
        "aot_autograd: done in %.2f s (%s graph)",
        elapsed,
        "joint forward+backward" if training else "inference",
    )
    joint_gm = _compat.joint_graph_module(jd)
    added = [
        AutogradGuard.of(training),
        requires_grad_note(capture.input_sources, capture.local_scope, training),
        *shape_guards("aot_autograd", _compat.shape_env_guard_exprs(capture), guards),
    ]
    handoff = Handoff(
        "aot_autograd",
        state,
        guards.extend(added),
        stage_timings(dynamo.timings, "aot_autograd", elapsed),
        training,
        joint=jd,
        dynamo_graph=gm,
        convention=(_compat.joint_placeholder_count(jd), None),
    )
    return AOTAutogradOutput(joint_gm, hand_out(handoff, joint_gm), handoff)
