"""A loop's repeated calls of one step: the guards checked once per input layout.

An artifact's guards walk the whole model at every call (4,000 checks for a
24-layer decoder, 0.3 ms on a CPU core), to find again, at every decode
step, what the loop that made the inputs already knows: the same model, the
same cache, the same kinds of input. :class:`LoopCall` checks them in full at
the loop's first call of each input layout; later calls of that layout check
what can still change between two steps and run:

- torch's global state (grad and inference mode, autocast, default dtype,
  torch function modes, ...), against what it was at the checked call;
- the layout of the inputs that change (type, shape, stride, dtype, device,
  requires_grad; Python values by value) and whether they share memory;
- module hooks, the identities the traced code used, index ranges: the
  runtime's other checks, run as at every call.

What it takes on trust is what a loop owns: the ``fixed`` inputs (the cache)
are the objects it was given, and the model is not changed between two
steps of one loop (a weight reassigned mid-loop, as a model edited while
another thread runs it, is not seen). vLLM calls its compiled model without
Dynamo's guards after the first compile for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .. import _compat


class LoopCall:
    """``loop(*moving)`` runs ``runtime((*moving, *fixed))``, with its guards checked
    at the first call of each layout of ``moving`` (see the module docstring)."""

    def __init__(self, runtime: Any, fixed: Sequence[Any] = ()) -> None:
        self._runtime = runtime  # a Runtime or a VariantRuntime
        self._fixed = tuple(fixed)
        # layout -> (the variant whose guards held, torch's state then unchanged)
        self._known: dict[Hashable, tuple[Any, Callable[[], bool]]] = {}

    def __call__(self, *moving: Any) -> Any:
        args = (*moving, *self._fixed)
        key = _layout(moving)
        known = self._known.get(key) if key is not None else None
        if known is not None and known[1]():
            return known[0].call_known(args)
        served, result = self._runtime.checked_call(args)
        if key is not None:
            self._known[key] = (served, _compat.global_state_unchanged())
        return result


def _layout(values: Sequence[Any]) -> Hashable | None:
    """What the guards read of the changing inputs, as a key; None where a value
    cannot be a key (an unhashable Python value, a tensor without a storage to
    compare: every call is checked in full)."""
    parts: list[Any] = [torch.is_inference_mode_enabled()]
    storages = []
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(
                (type(v), v.shape, v.stride(), v.dtype, v.device, v.requires_grad, v.is_inference())
            )
            try:
                storages.append(v.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a subclass with no storage
                return None
        else:
            try:
                hash(v)
            except TypeError:
                return None
            parts.append((type(v), v))
    parts.append(len(set(storages)) == len(storages))
    return tuple(parts)
