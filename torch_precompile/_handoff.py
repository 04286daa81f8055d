"""How a stage finds the previous stage's output when given its unpacked pieces.

A stage output unpacks to plain pieces (graph module, guards). Each piece
carries the output it came from: the graph module in its ``meta``, the
``Guards`` as a field. Nothing is kept process-wide, and nothing is written to
an earlier stage's output.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from .guards import Guards

_META_KEY = "torch_precompile_stage_output"
T = TypeVar("T")


def hand_out(output: Any, graph_module: torch.fx.GraphModule | None) -> Any:
    """Make ``output``'s pieces point back at it (done once, as it is built)."""
    # The frozen output is completed before anyone holds it: its Guards carry it.
    object.__setattr__(output, "guards", output.guards.handed_out_by(output))
    if graph_module is not None:
        graph_module.meta[_META_KEY] = output
    return output


def received(kind: type[T], graph_module: Any, guards: Guards | None) -> T | None:
    """The output of type ``kind`` that ``graph_module`` or ``guards`` was unpacked from."""
    if isinstance(graph_module, torch.fx.GraphModule):
        found = graph_module.meta.get(_META_KEY)
        if isinstance(found, kind):
            return found
    if guards is not None and isinstance(guards.stage_output, kind):
        return guards.stage_output  # type: ignore[no-any-return]
    return None


def graph_stage_output(graph_module: torch.fx.GraphModule) -> Any:
    """The stage output a graph module was handed out by (None: not from a stage)."""
    return graph_module.meta.get(_META_KEY)
