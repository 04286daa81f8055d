"""Readable input/output signatures, recorded in the artifact's header."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._compat.pytree import tree_leaves

# Field name -> its key in the header's ``signature`` object, in the order written.
_KEYS = {
    "parameters": "parameters",
    "text": "signature",
    "args": "args",
    "kwargs": "kwargs",
    "outputs": "outputs",
    "graph_inputs": "graph_inputs",
    "symbol_sources": "symbol_sources",
    "output_structure": "output_structure",
    "output_layouts": "output_layouts",
}


@dataclasses.dataclass(frozen=True)
class CallSignature:
    """What an artifact records of its example call and of its graph's inputs and outputs.

    The header's ``signature`` object, typed: :meth:`to_dict` writes it and
    :meth:`from_dict` reads it back. A field is None where the file does not
    record it (a file of torch's ``save_compiled_function``, an older version).
    """

    # The example call by parameter name (:func:`describe_value` descriptions).
    parameters: dict[str, Any] | None = None
    text: str | None = None  # the traced function's signature, ``(self, ids)``
    # The example call as given, when it did not bind to the parameters.
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None
    # Dtype and shape (or value) of each flat graph output.
    outputs: list[dict[str, Any]] | None = None
    # Where each graph input comes from (``L['x']``, ``L['self']._modules[...]``).
    graph_inputs: list[str] | None = None
    # Every input dimension each size symbol stands for (variants at size 1 use it).
    symbol_sources: dict[str, list[str]] | None = None
    # How the bytecode rebuilds the return value from the graph outputs (``to_python``).
    output_structure: dict[str, Any] | None = None
    # Eager's stride order of each graph output (None: any layout).
    output_layouts: list[list[int] | None] | None = None
    # Keys this version does not know, written back as they were read.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The header's ``signature`` object: the recorded fields by their keys."""
        recorded = {
            key: getattr(self, name)
            for name, key in _KEYS.items()
            if getattr(self, name) is not None
        }
        return {**recorded, **self.extra}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CallSignature:
        """The record a header's ``signature`` object holds (keys it lacks: None)."""
        fields = {name: data[key] for name, key in _KEYS.items() if key in data}
        extra = {k: v for k, v in data.items() if k not in _KEYS.values()}
        return cls(**fields, extra=extra)


def describe_value(value: Any) -> Any:
    """A JSON-able description of an example value (tensors by dtype, shape, device)."""
    if isinstance(value, torch.Tensor):
        return {
            "tensor": {
                "dtype": str(value.dtype).replace("torch.", ""),
                "shape": list(value.shape),
                "device": value.device.type,
                "requires_grad": bool(value.requires_grad),
                "contiguous": value.is_contiguous(),
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
) -> CallSignature:
    """The example call's arguments by parameter name (``self`` left out)."""
    full_args = (bound_self, *args) if bound_self is not None else args
    try:
        bound = signature.bind(*full_args, **kwargs)
    except TypeError:
        return CallSignature(
            args=[describe_value(a) for a in args],
            kwargs={k: describe_value(v) for k, v in kwargs.items()},
        )
    params = {
        name: describe_value(v)
        for name, v in bound.arguments.items()
        if not (bound_self is not None and v is bound_self)
    }
    return CallSignature(text=str(signature), parameters=params)


def describe_graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """Dtype and shape of each flat output of a graph (from its fake values)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "output":
            continue
        for arg in tree_leaves(node.args[0]):
            meta = getattr(arg, "meta", {})
            # Dynamo's graphs keep fake values under "example_value", ATen graphs under "val".
            val = meta.get("val", meta.get("example_value"))
            if isinstance(val, torch.Tensor):
                out.append(
                    {
                        "dtype": str(val.dtype).replace("torch.", ""),
                        "shape": [str(s) for s in val.shape],
                    }
                )
            else:
                out.append({"value": repr(val)})
    return out


def example_from_description(desc: Any, generator: torch.Generator | None = None) -> Any:
    """A value matching a :func:`describe_value` description, with random tensor data.

    Floating tensors are standard normal; integer tensors hold 0s and 1s (valid
    as indices into any embedding); Python values are the recorded ones.
    Raises ``ValueError`` for objects a description cannot rebuild.
    """
    if "tensor" in desc:
        t = desc["tensor"]
        dtype = getattr(torch, t["dtype"])
        shape = [int(s) for s in t["shape"]]
        # Drawn on the CPU (where the generator lives), then moved.
        if dtype.is_floating_point or dtype.is_complex:
            value = torch.randn(shape, dtype=dtype, generator=generator).to(t["device"])
            return value.requires_grad_(bool(t.get("requires_grad")))
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=generator).bool().to(t["device"])
        return torch.randint(0, 2, shape, dtype=dtype, generator=generator).to(t["device"])
    if "value" in desc:
        return desc["value"]
    for key, kind in (("tuple", tuple), ("list", list)):
        if key in desc:
            return kind(example_from_description(d, generator) for d in desc[key])
    if "dict" in desc:
        return {k: example_from_description(v, generator) for k, v in desc["dict"].items()}
    what = desc.get("dataclass") or desc.get("object") or desc
    raise ValueError(f"cannot build an example of {what}")


def example_call(
    signature: inspect.Signature, described: dict[str, Any], skip_first: bool, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments built from a recorded input signature.

    ``described`` maps parameter names to :func:`describe_value` descriptions
    (the ``parameters`` entry of an artifact's signature); ``skip_first``
    leaves out ``self``.
    """
    gen = torch.Generator().manual_seed(seed)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    params = list(signature.parameters.values())[1 if skip_first else 0 :]
    P = inspect.Parameter
    skipped = False
    for p in params:
        if p.name not in described:
            skipped = True  # not given in the example call: its default applies
            continue
        value = example_from_description(described[p.name], gen)
        if p.kind == P.VAR_POSITIONAL:
            args.extend(value)
        elif p.kind == P.VAR_KEYWORD:
            kwargs.update(value)
        elif p.kind == P.KEYWORD_ONLY or (skipped and p.kind == P.POSITIONAL_OR_KEYWORD):
            kwargs[p.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def make_binder(signature: inspect.Signature) -> Any:
    """A function mapping call arguments to ``{parameter: value}``, defaults applied.

    What ``signature.bind(...)`` followed by ``apply_defaults()`` returns, as
    generated Python (the interpreter binds the arguments: about a microsecond
    instead of ten). ``TypeError`` on a call the signature does not accept.
    """
    parts: list[str] = []
    names: list[str] = []
    defaults: dict[str, Any] = {}
    kind = inspect.Parameter
    previous = None
    for i, p in enumerate(signature.parameters.values()):
        if previous is kind.POSITIONAL_ONLY and p.kind is not kind.POSITIONAL_ONLY:
            parts.append("/")
        if p.kind is kind.KEYWORD_ONLY and previous not in (kind.KEYWORD_ONLY, kind.VAR_POSITIONAL):
            parts.append("*")
        text = p.name
        if p.kind is kind.VAR_POSITIONAL:
            text = "*" + p.name
        elif p.kind is kind.VAR_KEYWORD:
            text = "**" + p.name
        elif p.default is not p.empty:
            defaults[f"__default_{i}"] = p.default
            text = f"{p.name}=__default_{i}"
        parts.append(text)
        names.append(p.name)
        previous = p.kind
    if previous is kind.POSITIONAL_ONLY:
        parts.append("/")
    body = ", ".join(f"{name!r}: {name}" for name in names)
    source = f"def bind({', '.join(parts)}):\n    return {{{body}}}\n"
    namespace = dict(defaults)
    exec(compile(source, "<torch_precompile binder>", "exec"), namespace)
    return namespace["bind"]


def bind_call(
    signature: inspect.Signature, bound_self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A call's arguments by parameter name (defaults applied), ``self`` first if bound."""
    full = (bound_self, *args) if bound_self is not None else args
    return make_binder(signature)(*full, **kwargs)  # type: ignore[no-any-return]


def first_opaque(tree: dict[str, Any]) -> str | None:
    """Why the tree cannot be written as code (its first ``opaque`` leaf), or None."""
    if "opaque" in tree:
        return str(tree["opaque"])
    children: list[Any] = []
    for key in ("tuple", "list", "items"):
        children.extend(tree.get(key) or [])
    for key in ("dict", "fields"):
        children.extend(v for _, v in tree.get(key) or [])
    for child in children:
        why = first_opaque(child)
        if why is not None:
            return why
    return None


def describe(tree: dict[str, Any], outputs: Sequence[dict[str, Any]]) -> str:
    """The structure in words: ``ModelOutput(logits=Tensor(float32, (2, s0, 100)))``."""
    if "out" in tree:
        o = outputs[tree["out"]] if tree["out"] < len(outputs) else {}
        if "dtype" in o:
            return f"Tensor({o['dtype']}, ({', '.join(o['shape'])}))"
        return f"graph output {tree['out']}"
    if "in" in tree:
        return f"graph input {tree['in']}"
    if "const" in tree:
        return repr(tree["const"])
    if "opaque" in tree:
        return "?"
    if "tuple" in tree or "list" in tree:
        inner = ", ".join(describe(v, outputs) for v in tree.get("tuple", tree.get("list", [])))
        return f"({inner})" if "tuple" in tree else f"[{inner}]"
    name = str(tree.get("namedtuple") or tree.get("dataclass") or tree.get("class") or "")
    short = name.rpartition(":")[2].rpartition(".")[2]
    if "items" in tree:
        return f"{short}({', '.join(describe(v, outputs) for v in tree['items'])})"
    if "fields" in tree:
        return (
            f"{short}(" + ", ".join(f"{k}={describe(v, outputs)}" for k, v in tree["fields"]) + ")"
        )
    inner = ", ".join(f"{k!r}: {describe(v, outputs)}" for k, v in tree.get("dict", []))
    return f"{short}({{{inner}}})" if short else f"{{{inner}}}"
