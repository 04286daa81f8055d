"""Stage 2: AOTAutograd traces the joint forward+backward (or inference) ATen graph."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _compat
from .._compat.pytree import tree_leaves
from ..distributed.tracing import one_rank_tracing
from ..guards import AutogradGuard, Guard, Guards, ShapeGuard, requires_grad_note, shape_guards
from .dynamo import DynamoOutput, stage_timings
from .handoff import Handoff, hand_out, take_over

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


def new_shape_guards(capture: _compat.Capture, guards: Guards, phase: str) -> list[Guard]:
    """The capture's symbolic-shape guards that ``guards`` does not hold yet, as ``phase``'s."""
    known = {g.expression for g in guards.of_kind(ShapeGuard)}
    return shape_guards(
        phase, [e for e in _compat.shape_env_guard_exprs(capture) if e not in known]
    )


def check_calling_convention(
    gm: torch.fx.GraphModule, n_inputs: int, n_outputs: int | None, stage: str
) -> None:
    """A pass may rewrite a graph's body, not the inputs or outputs the runtime passes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != n_inputs:
        raise ValueError(
            f"the graph given to {stage} takes {len(placeholders)} inputs, but the capture passes "
            f"{n_inputs}: a graph pass must not add or remove placeholders"
        )
    if n_outputs is not None:
        outputs = [n for n in gm.graph.nodes if n.op == "output"]
        count = len(tree_leaves(outputs[0].args[0])) if outputs else 0
        if count != n_outputs:
            raise ValueError(
                f"the graph given to {stage} returns {count} values, but the capture expects "
                f"{n_outputs}: a graph pass must not add or remove outputs"
            )


def count_outputs(gm: torch.fx.GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(tree_leaves(out.args[0]))


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
    state = dynamo.state
    capture = state.capture
    check_calling_convention(
        gm, len(capture.fake_inputs), count_outputs(capture.graph_module), "aot_autograd"
    )
    log.info("aot_autograd: tracing the ATen graph")
    start = time.perf_counter()
    # Later stages run under the capture's grad mode: it decides training vs inference.
    with torch.set_grad_enabled(state.grad_enabled), one_rank_tracing(state.model):
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
        *new_shape_guards(capture, guards, "aot_autograd"),
    ]
    handoff = Handoff(
        "aot_autograd",
        state,
        guards.extend(added),
        stage_timings(dynamo.timings, "aot_autograd", elapsed),
        training,
        joint=jd,
        dynamo_graph=gm,
    )
    return AOTAutogradOutput(joint_gm, hand_out(handoff, joint_gm), handoff)
