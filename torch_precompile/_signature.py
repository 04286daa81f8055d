"""Readable input/output signatures, recorded in the artifact's header."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def describe_value(value: Any) -> Any:
    """A JSON-able description of an example value (tensors by dtype, shape, device)."""
    if isinstance(value, torch.Tensor):
        return {
            "tensor": {
                "dtype": str(value.dtype).replace("torch.", ""),
                "shape": list(value.shape),
                "device": value.device.type,
                "requires_grad": bool(value.requires_grad),
            }
        }
    if isinstance(value, (bool, int, float, str)) or value is None:
        return {"value": value, "type": type(value).__name__}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [describe_value(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): describe_value(v) for k, v in value.items()}}
    if hasattr(value, "__dataclass_fields__"):
        fields = {k: describe_value(getattr(value, k)) for k in value.__dataclass_fields__}
        return {"dataclass": type(value).__qualname__, "fields": fields}
    return {"object": type(value).__qualname__}


def describe_inputs(
    signature: inspect.Signature, bound_self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The example call's arguments by parameter name (``self`` left out)."""
    full_args = (bound_self, *args) if bound_self is not None else args
    try:
        bound = signature.bind(*full_args, **kwargs)
    except TypeError:
        return {"args": [describe_value(a) for a in args], "kwargs": {k: describe_value(v) for k, v in kwargs.items()}}
    params = {name: describe_value(v) for name, v in bound.arguments.items() if not (bound_self is not None and v is bound_self)}
    return {"parameters": params, "signature": str(signature)}


def describe_graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """Dtype and shape of each flat output of a graph (from its fake values)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "output":
            continue
        for arg in torch.utils._pytree.tree_leaves(node.args[0]):
            val = getattr(arg, "meta", {}).get("val") if hasattr(arg, "meta") else None
            if isinstance(val, torch.Tensor):
                out.append({"dtype": str(val.dtype).replace("torch.", ""), "shape": [str(s) for s in val.shape]})
            else:
                out.append({"value": repr(val)})
    return out
