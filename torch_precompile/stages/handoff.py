"""How a stage takes over from the one before it, given its output or its unpacked pieces.

A stage builds a :class:`Handoff` (what the next stage needs) and returns it
inside its output, a frozen value; nothing is written to the output, to the
graph module (its ``meta`` stays the compiler's) or to the ``Guards``
afterwards. The seed's spelling passes only the pieces an output unpacks to
(``joint, guards = Precompile.aot_autograd(gm, guards)``), so this module keeps
one table from each handed-out piece, by identity, to its handoff, weak on
the piece: an entry lives as long as the piece the caller holds.

- The ``Guards`` a stage hands out map to its handoff. They are a new object
  the handoff does not hold, so the table never keeps them alive.
- The graph module maps to the handoff weakly: the handoff holds the graph
  module (the capture does), and a strong entry would keep it, and the model,
  alive for good. A graph module passed alone is found while its stage's
  output or guards live.
- The compiled code (:class:`CompiledGraphs`) is this package's own value: it
  holds its handoff.

:func:`take_over` is the one place a stage finds its predecessor's handoff.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..guards import Guards

if TYPE_CHECKING:
    from .dynamo import CaptureState


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


@dataclasses.dataclass(frozen=True)
class CompiledGraphs:
    """Inductor's compiled forward (and backward), callable with the graph's flat inputs."""

    fn: Any = dataclasses.field(repr=False)
    handoff: Handoff = dataclasses.field(repr=False, compare=False)
    # The C++ kernels' shared objects by key, taken as Inductor returned them.
    kernels: Mapping[str, bytes] = dataclasses.field(default_factory=dict, repr=False)

    def __call__(self, *flat_inputs: Any) -> Any:
        return self.fn(*flat_inputs)


class _ByIdentity:
    """Values by the identity of live objects; an entry goes when its object is collected."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Any, value: Any) -> None:
        ident = id(key)

        def drop(ref: weakref.ref[Any]) -> None:
            if self._entries.get(ident, (None,))[0] is ref:
                del self._entries[ident]

        self._entries[ident] = (weakref.ref(key, drop), value)

    def get(self, key: Any) -> Any:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None


_HANDED_OUT = _ByIdentity()


def hand_out(handoff: Handoff, graph_module: torch.fx.GraphModule | None = None) -> Guards:
    """The guards to hand out with ``handoff``, which they (and ``graph_module``, the
    stage's own product) lead back to."""
    guards = handoff.guards.extend(())  # a new object, which the handoff does not hold
    _HANDED_OUT.put(guards, handoff)
    if graph_module is not None:
        _HANDED_OUT.put(graph_module, weakref.ref(handoff))
    return guards


def handed_out(piece: Any) -> Handoff | None:
    """The handoff a piece a stage handed out leads back to (None: not one, or gone)."""
    if isinstance(piece, CompiledGraphs):
        return piece.handoff
    found = _HANDED_OUT.get(piece)
    return found() if isinstance(found, weakref.ref) else found


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
        handoff = handed_out(value) or (handed_out(guards) if guards is not None else None)
    else:
        raise TypeError(
            f"{stage}() takes the output of Precompile.{producer} (or what it unpacked to), "
            f"got {type(value).__name__}"
        )
    if handoff is None or handoff.stage != producer:
        what = "graph module" if isinstance(piece, torch.fx.GraphModule) else "compiled code"
        raise ValueError(
            f"this {what} does not come from Precompile.{producer}, or was passed without "
            "the guards it was handed out with; pass that stage's output, or the pieces it "
            "unpacked to"
        )
    return handoff, piece, guards if guards is not None else handoff.guards
