"""The four stages in one pass, for :meth:`Precompile.compile`: each stage's output is
handed straight to the next (its handoff, graph and guards), so nothing is looked up
or checked that the stage before has just made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..runtime.artifact import PrecompiledArtifact
from .aot_autograd import trace_joint
from .dynamo import dynamo
from .inductor import compile_graphs
from .precompile import make_artifact


def run_stages(
    model: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    dynamic: bool | None,
    size_oblivious: bool | None,
    decompositions: dict[Any, Callable[..., Any]] | None,
    mode: str | None,
    options: dict[str, Any] | None,
) -> PrecompiledArtifact:
    """Dynamo, AOTAutograd, Inductor and precompile, as the four calls would run them."""
    captured = dynamo(model, args, kwargs, dynamic=dynamic, size_oblivious=size_oblivious)
    handoff = captured._handoff
    joint = trace_joint(handoff, captured.graph_module, handoff.guards, decompositions)
    handoff = joint._handoff
    compiled = compile_graphs(handoff, joint.joint_graph, handoff.guards, mode, options)
    return make_artifact(compiled._handoff, compiled.compiled)
