"""What keeps a generator's step servable by torch alone, checked and arranged at build.

A generator file is served where the model's library cannot be imported, so its
graph may call only operators torch itself registers. Two things here:

- :func:`torch_only_decompositions`: transformers' mixture-of-experts layers,
  compiled in float32 or float16, call
  ``torch.ops.transformers.grouped_mm_fallback``, an operator only
  ``import transformers.integrations.moe`` registers; AOTAutograd decomposes
  it into torch operators (:func:`grouped_mm`). The model is not changed.
- :func:`refuse_foreign_ops`: any operator of a namespace torch does not
  provide that is left in the ATen graph is refused with a
  :class:`~torch_precompile.CaptureError` naming it, at build rather than at
  the first ``generate``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .._errors import CaptureError

log = logging.getLogger("torch_precompile")

# The operator namespaces torch registers itself (C++ and Python), torch 2.11 to 2.15:
# a graph calling only these runs where torch alone is imported.
TORCH_NAMESPACES = frozenset(
    {
        "aten", "prim", "prims", "rngprims", "debugprims", "inductor", "inductor_prims",
        "_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor", "symm_mem",
        "quantized", "_quantized", "quantization", "mkl", "mkldnn", "mkldnn_prepacked",
        "onednn", "profiler", "sparse", "_native", "streams", "higher_order",
    }
)  # fmt: skip


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``transformers::grouped_mm_fallback`` in torch operators, with no data-dependent
    shape: rows sorted by expert, ``offs`` each expert's end; every expert's product is
    taken over all rows and each row keeps its own expert's (static shapes, at the cost
    of computing each row with every expert)."""
    rows = torch.arange(input.shape[0], device=input.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)
    out = input.new_zeros((input.shape[0], weight.shape[2]))
    for expert in range(weight.shape[0]):
        out = torch.where((group == expert)[:, None], input @ weight[expert], out)
    return out


def torch_only_decompositions() -> dict[Any, Callable[..., Any]]:
    """AOTAutograd's decompositions plus one into torch operators for each operator a
    model library registers that has one here (transformers' grouped_mm fallback)."""
    table = dict(_compat.default_decompositions())
    try:
        fallback = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):  # transformers' MoE integration not imported
        return table
    table[fallback] = grouped_mm
    return table


def _op_name(target: Any) -> str | None:
    """``namespace::name`` of an operator (an ``OpOverload`` or its packet), else None."""
    if type(target).__module__ != "torch._ops":
        return None
    qualified = getattr(target, "_qualified_op_name", None)  # a packet
    if qualified is None:
        name = getattr(target, "name", None)
        qualified = name() if callable(name) else None
    return qualified if isinstance(qualified, str) and "::" in qualified else None


def foreign_ops(graph_module: torch.fx.GraphModule) -> list[str]:
    """The operators ``graph_module`` calls (directly, or wrapped by a higher-order
    operator such as ``auto_functionalized``) from namespaces torch does not provide."""
    found: list[str] = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        for target in (node.target, *node.args):
            name = _op_name(target)
            foreign = name is not None and name.split("::")[0] not in TORCH_NAMESPACES
            if foreign and name not in found:
                found.append(name)
    return found


def refuse_foreign_ops(graph_module: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A :class:`CaptureError` naming each operator a served file could not call."""
    found = foreign_ops(graph_module)
    if not found:
        return
    raise CaptureError(
        f"{type(model).__name__}: the generator's step calls {', '.join(found)}, an operator "
        "torch does not provide (a library registers it when imported), so a generator "
        "file could not run it where that library is absent. Compute that part with torch "
        "operators, or serve the model with its library (generate_with)"
    )
