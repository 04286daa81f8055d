"""Training artifacts on the lean path: an ``autograd.Function`` around Inductor's
compiled forward and backward, without AOTAutograd.

At save, :func:`autograd_spec` reads from AOTAutograd's cache entry the little
its runtime (``_AOTDispatchAutogradFunctionFactory`` in
``torch/_functorch/_aot_autograd/runtime_wrappers.py``) needs for a plain
graph: which forward outputs are the user's, which are tensors and sizes saved
for backward, which outputs are viewed with ``_unsafe_view`` or do not need a
gradient, which outputs' gradients the backward takes (and in what layout).
Tensor subclass (DTensor) inputs are flattened around the compiled pair by
``subclasses.py``, inside the ``autograd.Function`` as AOTAutograd does, so
that gradients reach the DTensor parameters. Anything else (input mutations
outside the graph, outputs aliasing inputs, RNG state, effect tokens, a lazily
compiled backward) is refused with a reason, and the artifact loads through
PyTorch's full path.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import inference
from .schema import AutogradSpec

# Inductor's CPU lowering of random ops (dropout, rand*) draws a seed with
# ``aten.randint`` and generates in its kernels (``normalized_rand_cpu``).
RNG_IN_WRAPPER = re.compile(
    r"inductor_seeds|inductor_random|inductor_randint|aten\.rand|normalized_rand|rand\w*_cpu"
    r"|\brand(?!_strided)\w*\(|bernoulli|philox"
)


def _coerce_tangent(x: Any, layout: Any) -> Any:
    """AOTAutograd's ``coerce_to_expected_memory_format`` for a plain tensor."""
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(layout, torch.memory_format):
        return x if x.is_contiguous(memory_format=layout) else x.contiguous(memory_format=layout)
    size, stride = layout
    if tuple(x.shape) == size and x.stride() == stride:
        return x
    out = torch.empty_strided(size, stride, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out


def make_autograd_call(
    spec: AutogradSpec,
    forward: Callable[[list[Any]], Any],
    backward: Callable[[list[Any]], Any],
    wrap_gradients: Callable[[Any], tuple[Any, ...]] = tuple,
) -> Callable[..., Any]:
    """``fn(*graph_inputs)`` returning the user's outputs, differentiable through
    the compiled backward (Dynamo's calling convention for the graph).
    ``wrap_gradients``: the backward's outputs as the inputs' gradients (DTensor
    gradients rebuilt from their local shards)."""
    # As AOTAutograd's cache entry decides at load: autocast on now means the
    # compiled graphs (which already hold its casts) run with it off.
    amp_off = torch._C._DisableAutocast if torch._C._is_any_autocast_enabled() else None

    class CompiledFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            if amp_off is not None:
                with amp_off():
                    fw_outs = forward(list(args))
            else:
                fw_outs = forward(list(args))
            saved = [x.detach() if x._is_view() else x for x in fw_outs[spec.saved_vc_check]]
            ctx.save_for_backward(*saved)
            ctx.no_vc_check = [
                x.detach() if x._is_view() else x for x in fw_outs[spec.saved_no_vc_check]
            ]
            ctx.symints = fw_outs[spec.saved_symints]
            ctx.opaque = fw_outs[spec.saved_opaque]
            raw = list(fw_outs[: spec.num_forward_returns])
            for i in spec.unsafe_view_outputs:
                raw[i] = torch.ops.aten._unsafe_view(raw[i], raw[i].shape)
            ctx.mark_non_differentiable(
                *[raw[i] for i in spec.non_differentiable if isinstance(raw[i], torch.Tensor)]
            )
            ctx._materialize_non_diff_grads = False
            return tuple(raw)

        @staticmethod
        @once_differentiable  # as AOTAutograd: no double backward through compiled code
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            if spec.donated_buffers and torch._C._autograd._get_current_graph_task_keep_graph():
                raise RuntimeError(
                    "This backward function was compiled with donated buffers, which "
                    "requires retain_graph=False; keep backward(retain_graph=False)"
                )
            if spec.nondeterministic and torch.are_deterministic_algorithms_enabled():
                raise RuntimeError(
                    "This compiled backward is being run with "
                    "torch.use_deterministic_algorithms(True), but it was compiled with it off"
                )
            saved = (*ctx.saved_tensors, *ctx.no_vc_check)
            tangents = [
                _coerce_tangent(grads[i], layout)
                for i, layout in zip(spec.tangent_outputs, spec.tangent_layouts)
            ]
            all_args = [*ctx.symints, *saved, *ctx.opaque, *tangents]
            del saved, tangents
            ctx.maybe_clear_saved_tensors()
            ctx.no_vc_check = ctx.opaque = None
            if amp_off is not None:
                with amp_off():
                    out = backward(all_args)
            else:
                out = backward(all_args)
            return wrap_gradients(out)

    bumped = tuple(spec.mutated_seen_by_autograd)

    def call(*args: Any) -> Any:
        if bumped:
            inference.bump_versions(args, bumped)
        with torch.enable_grad():
            return CompiledFunction.apply(*args)

    return call
