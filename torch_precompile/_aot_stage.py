"""Stage 2: AOTAutograd traces the joint forward+backward (or inference) ATen graph."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from . import _capture_registry, _compat, _distributed
from ._dynamo_stage import CaptureState, DynamoOutput, stage_timings
from ._guards import Guard, Guards, describe_source

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass(frozen=True)
class AOTAutogradOutput:
    """The joint (training) or inference ATen graph; unpacks to ``(joint_graph, guards)``."""

    joint_graph: torch.fx.GraphModule
    guards: Guards
    _state: CaptureState = dataclasses.field(repr=False, compare=False)
    _joint: Any = dataclasses.field(repr=False, compare=False)
    _dynamo_graph: torch.fx.GraphModule = dataclasses.field(repr=False, compare=False)
    _timings: Mapping[str, float] = dataclasses.field(repr=False, compare=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.joint_graph, self.guards))

    @property
    def training(self) -> bool:
        """True for a joint forward+backward graph, False for an inference graph."""
        return _compat.joint_needs_autograd(self._joint)

    def as_text(self) -> str:
        """The joint (or inference) ATen graph as Python code."""
        kind = "joint forward+backward" if self.training else "inference"
        return f"# AOTAutograd {kind} graph\n" + self.joint_graph.code.strip()


def resolve_capture(obj: Any, guards: Guards | None, what: str) -> CaptureState:
    state = _capture_registry.lookup(obj, guards)
    if state is None:
        raise ValueError(
            f"{what} does not come from Precompile.dynamo (or its capture is gone); "
            "pass the previous stage's output, or the graph module and guards it returned"
        )
    return state


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
        count = len(torch.utils._pytree.tree_leaves(outputs[0].args[0])) if outputs else 0
        if count != n_outputs:
            raise ValueError(
                f"the graph given to {stage} returns {count} values, but the capture expects "
                f"{n_outputs}: a graph pass must not add or remove outputs"
            )


def count_outputs(gm: torch.fx.GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(torch.utils._pytree.tree_leaves(out.args[0]))


def aot_autograd(
    gm_or_dynamo_output: torch.fx.GraphModule | DynamoOutput,
    guards: Guards | None = None,
    *,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> AOTAutogradOutput:
    """Trace the ATen graph of a Dynamo graph once, with AOTAutograd."""
    if isinstance(gm_or_dynamo_output, DynamoOutput):
        gm, guards = gm_or_dynamo_output.graph_module, guards or gm_or_dynamo_output.guards
        state = gm_or_dynamo_output._state
        earlier: Mapping[str, float] = gm_or_dynamo_output._timings
    else:
        gm = gm_or_dynamo_output
        if not isinstance(gm, torch.fx.GraphModule):
            raise TypeError(
                f"expected a DynamoOutput or torch.fx.GraphModule, got {type(gm).__name__}"
            )
        state = resolve_capture(gm, guards, "this graph module")
        dynamo_out = _capture_registry.output_of(DynamoOutput, gm, guards)
        earlier = dynamo_out._timings if dynamo_out is not None else {}
        guards = guards if guards is not None else Guards(capture_id=state.capture_id)
    capture = state.capture
    check_calling_convention(
        gm, len(capture.fake_inputs), count_outputs(capture.graph_module), "aot_autograd"
    )
    shape_before = len(_compat.shape_env_guard_exprs(capture))
    log.info("aot_autograd: tracing the ATen graph")
    start = time.perf_counter()
    # Later stages run under the capture's grad mode: it decides training vs inference.
    with torch.set_grad_enabled(state.grad_enabled), _distributed.one_rank_tracing(state.model):
        jd = _compat.export_joint(capture, gm, decompositions)
    elapsed = time.perf_counter() - start
    training = _compat.joint_needs_autograd(jd)
    log.info(
        "aot_autograd: done in %.2f s (%s graph)",
        elapsed,
        "joint forward+backward" if training else "inference",
    )
    joint_gm = _compat.joint_graph_module(jd)
    _capture_registry.tag(joint_gm, state.capture_id, state)
    added = [_grad_mode_guard(training), _requires_grad_guard(capture, training)]
    for expr in _compat.shape_env_guard_exprs(capture)[shape_before:]:
        added.append(Guard("aot_autograd", "shape", expr, None, expr))
    timings = stage_timings(earlier, "aot_autograd", elapsed)
    out = AOTAutogradOutput(joint_gm, guards.extend(added), state, jd, gm, timings)
    _capture_registry.link_output(out, joint_gm, out.guards)
    return out


def _grad_mode_guard(training: bool) -> Guard:
    if training:
        expr = "training artifact: call with grad enabled (outputs carry grad_fn)"
    else:
        expr = (
            "inference artifact: runs without autograd; "
            "with grad enabled, nothing it reads may require grad"
        )
    return Guard("aot_autograd", "autograd", expr, "grad mode", training)


def _requires_grad_guard(capture: _compat.Capture, training: bool) -> Guard:
    scope = {"L": capture.local_scope}
    names = []
    for source in capture.input_sources:
        try:
            value = eval(source, {"__builtins__": {}}, scope)
        except Exception:
            continue
        if isinstance(value, torch.Tensor) and value.requires_grad:
            names.append(describe_source(source))
    if not training:
        expr = "no gradients are computed"
    elif len(names) > 6:
        expr = f"gradients flow to {len(names)} inputs: {', '.join(names[:6])}, ..."
    else:
        expr = f"gradients flow to: {', '.join(names) or 'nothing'}"
    return Guard("aot_autograd", "requires_grad", expr)
