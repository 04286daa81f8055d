"""How a stage takes over from the one before it, given its output or its unpacked pieces.

A stage builds a :class:`Handoff` (what the next stage needs) and returns it
inside its output, a frozen value; nothing is written to the output, to the
graph module's ``meta`` (it stays the compiler's) or to the ``Guards``
afterwards. The seed's spelling passes only the pieces an output unpacks to
(``joint, guards = Precompile.aot_autograd(gm, guards)``), so each piece a
stage hands out carries the way back to its handoff itself; no table does:

- The ``Guards`` a stage hands out are a new collection carrying its handoff
  (:meth:`Guards.carrying`); the handoff holds other ``Guards``, so it lives
  exactly as long as the caller keeps the guards (or the output).
- The graph module carries a weak lead (:class:`_Lead`, set when handed out):
  the handoff holds the graph module (the capture does), and a strong one
  would keep the handoff, and the model, alive for good. A graph module passed
  alone is found while its stage's output or guards live.
- The compiled code (:class:`CompiledGraphs`) is this package's own value: it
  holds its handoff.

:func:`take_over` is the one place a stage finds its predecessor's handoff, and checks
that a graph passed in its place keeps the calling convention the handoff declares.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import _compat
from .._compat.pytree import tree_leaves
from ..guards import Guards
from ..runtime.signature import CallSignature


@dataclasses.dataclass(frozen=True)
class CaptureState:
    """What later stages need from the capture; private, shared by reference.

    Built once by the Dynamo stage and only read afterwards: what a later stage
    learns (its timing, training or inference, its guards) lives in that
    stage's output. (Later stages trace with the capture's shape environment,
    which records their symbolic-shape guards; each stage reports as its own
    the ones not already in its input's guards.)
    """

    capture: _compat.Capture
    model: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    training: bool
    input_signature: CallSignature  # the example call (precompile adds the graph's side)
    capture_id: str  # names this capture: guards of another one are refused at save
    one_rank: bool  # traced under compile_on_one_rank (a DTensor model): every stage

    @property
    def grad_enabled(self) -> bool:
        """Grad mode at capture: later stages run under it (it decides training vs inference)."""
        return self.capture.grad_enabled


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
    # The inputs (and outputs, None: any) a graph passed in place of the stage's own
    # must keep: the runtime passes and reads exactly these.
    convention: tuple[int, int | None] | None = None


def stage_timings(earlier: Mapping[str, float], stage: str, seconds: float) -> Mapping[str, float]:
    """An earlier output's timings plus this stage's, as a new read-only mapping."""
    return types.MappingProxyType({**earlier, stage: seconds})


def count_outputs(gm: torch.fx.GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(tree_leaves(out.args[0]))


def _check_calling_convention(
    gm: torch.fx.GraphModule, n_inputs: int, n_outputs: int | None, stage: str
) -> None:
    """A pass may rewrite a graph's body, not the inputs or outputs the runtime passes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != n_inputs:
        raise ValueError(
            f"the graph given to {stage} takes {len(placeholders)} inputs, but the capture passes "
            f"{n_inputs}: a graph pass must not add or remove placeholders"
        )
    if n_outputs is not None and count_outputs(gm) != n_outputs:
        raise ValueError(
            f"the graph given to {stage} returns {count_outputs(gm)} values, but the capture "
            f"expects {n_outputs}: a graph pass must not add or remove outputs"
        )


@dataclasses.dataclass(frozen=True)
class CompiledGraphs:
    """Inductor's compiled forward (and backward), callable with the graph's flat inputs."""

    fn: Any = dataclasses.field(repr=False)
    handoff: Handoff = dataclasses.field(repr=False, compare=False)
    # The C++ kernels' shared objects by key, taken as Inductor returned them.
    kernels: Mapping[str, bytes] = dataclasses.field(default_factory=dict, repr=False)

    def __call__(self, *flat_inputs: Any) -> Any:
        return self.fn(*flat_inputs)


_LEAD = "_torch_precompile_lead"  # the attribute of a handed-out graph module


class _Lead:
    """A handed-out graph module's weak way back to its stage's handoff.

    A pickled module (Inductor's cache keys pickle graph modules) leads nowhere;
    so does a copy (``GraphModule.__deepcopy__`` builds a new module): a pass that
    returns a new module passes the guards with it.
    """

    __slots__ = ("_ref",)

    def __init__(self, handoff: Handoff | None = None) -> None:
        self._ref = weakref.ref(handoff) if handoff is not None else None

    def __call__(self) -> Handoff | None:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> tuple[type[_Lead], tuple[()]]:
        return (_Lead, ())


def hand_out(handoff: Handoff, graph_module: torch.fx.GraphModule | None = None) -> Guards:
    """The guards to hand out with ``handoff``, carrying it; ``graph_module`` (the
    stage's own product) gets a weak lead back to it."""
    if graph_module is not None:
        graph_module.__dict__[_LEAD] = _Lead(handoff)
    return handoff.guards.carrying(handoff)


def handed_out(piece: Any) -> Handoff | None:
    """The handoff a piece a stage handed out leads back to (None: not one, or gone)."""
    if isinstance(piece, CompiledGraphs):
        return piece.handoff
    if isinstance(piece, Guards):
        carried = piece._carried
        return carried if isinstance(carried, Handoff) else None
    if isinstance(piece, torch.fx.GraphModule):
        lead = piece.__dict__.get(_LEAD)
        return lead() if isinstance(lead, _Lead) else None
    return None


def take_over(
    value: Any, guards: Guards | None, output_type: type, producer: str, stage: str
) -> tuple[Handoff, Any, Guards]:
    """``(handoff, piece, guards)`` from ``producer``'s output or the piece it unpacked to.

    ``piece`` is what the output unpacks to first (the graph, or the compiled
    code); ``guards`` defaults to the ones the producer handed out. A graph must
    keep the handoff's calling convention (a pass may have replaced it).
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
    if isinstance(piece, torch.fx.GraphModule) and handoff.convention is not None:
        _check_calling_convention(piece, *handoff.convention, stage)
    return handoff, piece, guards if guards is not None else handoff.guards
