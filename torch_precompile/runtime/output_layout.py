"""Outputs in eager's memory layout, so the state one call returns fits the next call.

Inductor may return an output in another layout than eager would: a prefill's
KV cache built by ``torch.cat`` onto an empty cache comes back as the
projection's transposed view, ``(B, L, H, D)`` memory for a ``(B, H, L, D)``
tensor. The values are right, but the next call's guards check the strides
that eager's cache has, so a generation loop would refuse its own cache.
The layout eager gives each output (its stride order, read from Dynamo's
graph, which traced with eager's semantics) is saved with the artifact, and an
output in another order is copied into that order (a prefill's cache, once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat


def stride_orders(values: Sequence[Any]) -> list[list[int] | None]:
    """Each output's dimensions from outermost to innermost, by stride (None: not a
    tensor, or one with a broadcast dimension)."""
    out: list[list[int] | None] = []
    for v in values:
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            out.append(None)
            continue
        strides = [_compat.size_hint(s) for s in v.stride()]
        sizes = [_compat.size_hint(s) for s in v.shape]
        if None in strides or None in sizes or 0 in strides:
            out.append(None)
            continue
        out.append(_order(strides))
    return out


def _order(strides: Sequence[int]) -> list[int]:
    return sorted(range(len(strides)), key=lambda d: (-strides[d], d))


def _dense(sizes: Sequence[int], strides: Sequence[int], order: list[int]) -> bool:
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def _follows(t: torch.Tensor, order: list[int]) -> bool:
    """Whether ``t`` is in eager's layout: the exact dense strides of ``order`` (size-1
    dimensions included: Dynamo guards those too), or a view that keeps the order (eager
    returns a slice of a larger tensor, a sliding-window cache's, in the same order)."""
    strides, sizes = list(t.stride()), list(t.shape)
    if strides == _strides(sizes, order):
        return True
    return (
        0 not in strides
        and not _dense(sizes, strides, _order(strides))
        and (_order(strides) == order)
    )


def _strides(sizes: list[int], order: list[int]) -> list[int]:
    strides = [0] * len(sizes)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(sizes[d], 1)
    return strides


def _relayout(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    strides = _strides(list(t.shape), order)
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def keep_layouts(
    call: Callable[..., Any], orders: Sequence[list[int] | None]
) -> Callable[..., Any]:
    """``call`` (a compiled graph) with each output put in its recorded stride order."""
    todo = [(i, o) for i, o in enumerate(orders) if o is not None]
    if not todo:
        return call

    def call_in_eager_layout(*args: Any) -> Any:
        outs = call(*args)
        for i, order in todo:
            t = outs[i] if i < len(outs) else None
            if isinstance(t, torch.Tensor) and t.dim() == len(order) and not _follows(t, order):
                outs = list(outs)
                outs[i] = _relayout(t, order)
        return outs

    call_in_eager_layout.__wrapped__ = call  # type: ignore[attr-defined]
    return call_in_eager_layout
