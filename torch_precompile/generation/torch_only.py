"""What keeps a generator's step servable by torch alone, checked and arranged at build.

A generator file is served where the model's library cannot be imported, so its
graph may call only operators torch itself registers, and its file may name nothing
of that library. Three things here:

- :func:`torch_only_decompositions`: transformers' mixture-of-experts layers,
  compiled in float32 or float16, call
  ``torch.ops.transformers.grouped_mm_fallback``, an operator only
  ``import transformers.integrations.moe`` registers; AOTAutograd decomposes
  it into torch operators (:func:`grouped_mm`). The model is not changed.
- :func:`refuse_foreign_ops`: any operator of a namespace torch does not
  provide that is left in the ATen graph is refused with a
  :class:`~torch_precompile.CaptureError` naming it, at build rather than at
  the first ``generate``.
- :func:`refuse_library_imports`: the file the build makes, read as ``inspect``
  reads it, names no module of a model library (transformers, diffusers,
  sentence_transformers) that its load would import, and its module stand-in
  meets every guard; otherwise a :class:`~torch_precompile.CaptureError` naming
  the reference and the place that needs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .._errors import CaptureError
from ..serialization.load_imports import PROVIDED_NAMESPACES, library_references
from ..serialization.save import file_parts, unmet_by_standin

log = logging.getLogger("torch_precompile")


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
    operator such as ``auto_functionalized``) from namespaces neither torch nor this
    package provides."""
    found: list[str] = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        for target in (node.target, *node.args):
            name = _op_name(target)
            foreign = name is not None and name.split("::")[0] not in PROVIDED_NAMESPACES
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


def refuse_library_imports(built: Any, model: torch.nn.Module) -> None:
    """A :class:`CaptureError` when the file ``built`` (a generator) makes would import
    a model library where it is loaded (every global its pickles name, read with
    ``pickletools``; every module its stand-in or compiled bytecode reads; every
    operator its kernels call: ``serialization/load_imports.py``), each named with the
    place that needs it; or when the stand-in that file rebuilds, without those
    libraries, fails a guard of a variant. Runs what save runs, without packing the
    weights."""
    started = time.perf_counter()
    parts = file_parts(built, weights=False)
    log.info("generator: the file made in memory in %.1f s", time.perf_counter() - started)
    found = library_references(parts.header.imports or {"load": {}})
    name = type(model).__name__
    if found:
        named = "; ".join(f"{module} ({', '.join(places)})" for module, places in found.items())
        raise CaptureError(
            f"{name}: the generator's file would import {named} where it is loaded, and a "
            "generator file is served where the model's library cannot be imported. "
            "Compute that part with torch, or serve the model with its library "
            "(generate_with)"
        )
    if parts.skeleton is None or parts.tensors is None or parts.layout is not None:
        return  # a tensor-parallel model's stand-in is built from each rank's shard
    per_variant = unmet_by_standin(parts.artifact, parts.skeleton, parts.tensors, identities=True)
    for i, unmet in enumerate(per_variant):
        if unmet:
            raise CaptureError(
                f"{name}: the generator's file, served without the model's library, would "
                f"refuse every call of variant {i}: its stand-in of the model fails "
                f"{'; '.join(unmet)}. Make that attribute a plain value, or serve the "
                "model with its library (generate_with)"
            )
