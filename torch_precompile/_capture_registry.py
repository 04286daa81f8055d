"""Links the pieces a stage hands out (graph modules, guards) to their capture.

Stages accept either the previous stage's whole output or its unpacked
pieces; an unpacked graph module or ``Guards`` finds its way back to the
capture state, and to the stage output it was unpacked from, through this
registry. The links only point back: no later stage writes to what they find.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

import torch

_META_KEY = "torch_precompile_capture_id"
_OUTPUT_KEY = "torch_precompile_stage_output"
_registry: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
# Stage outputs by the id of the Guards they hold (an output holds its Guards,
# so the id is not reused while the entry lives).
_outputs_by_guards: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register(state: Any) -> str:
    """Remember ``state`` under a fresh id (as long as something holds it)."""
    capture_id = uuid.uuid4().hex
    _registry[capture_id] = state
    return capture_id


def tag(gm: torch.fx.GraphModule, capture_id: str, state: Any) -> None:
    """Mark a graph module as produced by a capture (kept through in-place passes)."""
    gm.meta[_META_KEY] = capture_id
    # Holding the state on the graph keeps it alive while the user holds the graph.
    gm.meta[_META_KEY + "_state"] = state


def lookup(*candidates: Any) -> Any | None:
    """Find the capture state from graph modules or Guards, first hit wins."""
    for obj in candidates:
        capture_id = None
        if isinstance(obj, torch.fx.GraphModule):
            capture_id = obj.meta.get(_META_KEY)
        elif obj is not None:
            capture_id = getattr(obj, "capture_id", None)
        if capture_id is not None and capture_id in _registry:
            return _registry[capture_id]
    return None


def link_output(output: Any, gm: torch.fx.GraphModule, guards: Any) -> None:
    """Let the graph module and the Guards a stage output unpacks to find that output."""
    gm.meta[_OUTPUT_KEY] = output
    _outputs_by_guards[id(guards)] = output


def output_of(kind: type, gm: Any, guards: Any) -> Any | None:
    """The stage output of type ``kind`` that ``gm`` or ``guards`` was unpacked from."""
    if isinstance(gm, torch.fx.GraphModule):
        found = gm.meta.get(_OUTPUT_KEY)
        if isinstance(found, kind):
            return found
    if guards is not None:
        found = _outputs_by_guards.get(id(guards))
        if isinstance(found, kind) and found.guards is guards:
            return found
    return None
