"""AOTAutograd's runtime wrapper around an inference graph, lean: input mutations
kept in the graph, and outputs that alias the inputs.

AOTAutograd functionalizes a graph that writes into its inputs (a KV cache
updated in place, a counter buffer) and, for an inference graph, keeps the
writes in the compiled graph (``MutationType.MUTATED_IN_GRAPH``): Inductor's
kernels write the input's memory, and the runtime wrapper only bumps the
version counters autograd sees. An output that is, or is a view of, an input
comes back from the compiled graph as a fresh tensor over the same memory;
the runtime wrapper makes it a real view of the caller's tensor again
(``gen_alias_from_base``). This module does those two things from a spec read
off AOTAutograd's cache entry at save, the way
``torch/_functorch/_aot_autograd/runtime_wrappers.py`` does them with
``config.view_replay_for_aliased_outputs`` off (``as_strided`` of the base,
at the output's place in the memory the graph received).
Anything else (mutations AOTAutograd applies outside the graph, aliases of
intermediates) is refused with a reason, and the artifact loads through
PyTorch's full path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .schema import InferenceSpec


def bump_versions(args: Any, indices: tuple[int, ...]) -> None:
    """Tell autograd that the compiled graph wrote these inputs (their version counters)."""
    for i in indices:
        torch.autograd.graph.increment_version(args[i])


def alias_of(
    base: torch.Tensor, out: torch.Tensor, received: torch.Tensor, requires_grad: bool
) -> torch.Tensor:
    """``out`` (the compiled graph's tensor over the memory of ``received``, the
    graph's copy or view of ``base``) as a view of ``base``: AOTAutograd's
    ``gen_alias_from_base`` without view replay, placed by ``out``'s byte offset
    from ``received``."""
    view_base = base if base.dtype == out.dtype else base.view(out.dtype)
    start = base.storage_offset() * base.element_size() + (out.data_ptr() - received.data_ptr())
    view = view_base.as_strided(out.size(), out.stride(), start // out.element_size())
    if base.requires_grad and not requires_grad:
        view = view.detach()
    elif not base.requires_grad and requires_grad:
        view.requires_grad_(True)
    return view


def mark_dynamic_dims(outs: Any, dynamic_dims: tuple[tuple[int, ...] | None, ...]) -> None:
    """AOTAutograd's ``mark_dynamo_propagated_dynamic_indices``: a hint (not a
    guard) that these output dimensions are dynamic, for a next compiled graph."""
    for t, dims in zip(outs, dynamic_dims):
        if dims is None or not isinstance(t, torch.Tensor):
            continue
        marked = getattr(t, "_dynamo_propagated_dynamic_indices", None)
        if marked is None:
            t._dynamo_propagated_dynamic_indices = set(dims)  # type: ignore[attr-defined]
        else:
            marked |= set(dims)


def make_inference_call(
    spec: InferenceSpec, call_list: Callable[[list[Any], list[Any] | None], Any]
) -> Callable[..., Any]:
    """``fn(*graph_inputs)`` (Dynamo's convention) around the compiled graph's
    boxed call (``call_list(inputs, received)``: see ``wrapper.GraphCall``)."""
    bumped = spec.mutated_seen_by_autograd
    aliases = spec.aliases
    dynamic_dims = spec.dynamic_dims
    if not bumped and not aliases and not dynamic_dims:
        return lambda *args: call_list(list(args), None)

    def call(*args: Any) -> Any:
        if bumped:
            bump_versions(args, bumped)
        received: list[Any] | None = [] if aliases else None
        result = call_list(list(args), received)
        if aliases:
            result = list(result)
            for i, alias in enumerate(aliases):
                if alias is None:
                    continue
                base_idx, is_input, requires_grad = alias
                base = args[base_idx]
                if is_input:
                    result[i] = base
                else:
                    result[i] = alias_of(base, result[i], received[base_idx], requires_grad)
        if dynamic_dims:
            mark_dynamic_dims(result, dynamic_dims)
        return result

    return call
