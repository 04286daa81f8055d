"""How a stage takes over from the one before it, given its output or its unpacked pieces.

A stage builds a :class:`Handoff` (what the next stage needs) before its
output, then the pieces the output unpacks to (the graph module, in its
``meta``; the ``Guards``, as a field; the compiled code, as a field) and the
output itself, each holding that handoff. So an output is complete when it is
built, nothing is written to it afterwards, and nothing is kept process-wide.
:func:`take_over` is the one place a stage finds its predecessor's handoff.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..guards import Guards

if TYPE_CHECKING:
    from .dynamo import CaptureState

_META_KEY = "torch_precompile_handoff"


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What one stage hands the next: the capture, the guards and timings so far,
    and the stage's own products the next stage compiles from."""

    stage: str  # who handed it out: "dynamo", "aot_autograd" or "inductor"
    state: CaptureState
    guards: Guards
    timings: Mapping[str, float]
    training: bool
    joint: Any = None  # aot_autograd: AOTAutograd's traced joint (its descriptors)
    dynamo_graph: torch.fx.GraphModule | None = None  # aot_autograd: the graph it traced

    def handed_out(self, graph_module: torch.fx.GraphModule | None = None) -> Guards:
        """The guards to hand out with this handoff; ``graph_module`` carries it too.

        The graph module is the stage's own product, not yet handed to anyone.
        """
        if graph_module is not None:
            graph_module.meta[_META_KEY] = self
        return self.guards.carrying(self)


@dataclasses.dataclass(frozen=True)
class CompiledGraphs:
    """Inductor's compiled forward (and backward), callable with the graph's flat inputs."""

    fn: Any = dataclasses.field(repr=False)
    handoff: Handoff = dataclasses.field(repr=False, compare=False)

    def __call__(self, *flat_inputs: Any) -> Any:
        return self.fn(*flat_inputs)


def _carried(piece: Any) -> Handoff | None:
    if isinstance(piece, torch.fx.GraphModule):
        found = piece.meta.get(_META_KEY)
        return found if isinstance(found, Handoff) else None
    if isinstance(piece, CompiledGraphs):
        return piece.handoff
    return None


def take_over(
    value: Any, guards: Guards | None, output_type: type, producer: str, stage: str
) -> tuple[Handoff, Any, Guards]:
    """``(handoff, piece, guards)`` from ``producer``'s output or the piece it unpacked to.

    ``piece`` is what the output unpacks to first (the graph, or the compiled
    code); ``guards`` defaults to the ones the producer handed out.
    """
    if isinstance(value, output_type):
        handoff: Handoff | None = value._handoff
        piece = next(iter(value))
    elif isinstance(value, (torch.fx.GraphModule, CompiledGraphs)):
        piece = value
        handoff = _carried(value) or (guards.handoff if guards is not None else None)
    else:
        raise TypeError(
            f"{stage}() takes the output of Precompile.{producer} (or what it unpacked to), "
            f"got {type(value).__name__}"
        )
    if handoff is None or handoff.stage != producer:
        what = "graph module" if isinstance(piece, torch.fx.GraphModule) else "compiled code"
        raise ValueError(
            f"this {what} does not come from Precompile.{producer}; pass that stage's output, "
            "or the pieces it unpacked to"
        )
    return handoff, piece, guards if guards is not None else handoff.guards
