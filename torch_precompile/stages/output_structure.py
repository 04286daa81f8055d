"""The structure of a model's return value, recorded once when the artifact is built.

Dynamo's bytecode calls the compiled graph with the flat graph inputs and
builds the model's return value from the flat graph outputs. To learn how,
``precompile`` runs that bytecode once on the capture's own example inputs
with the compiled graph replaced by a stub that returns empty ``meta``
tensors: no kernel runs, and each leaf of the return value is found by
identity among the stub's outputs or the graph's inputs. The result is a
small JSON tree saved with the artifact, which ``to_python()`` prints as code.

Encoding: ``{"out": i}`` graph output i, ``{"in": i}`` graph input i,
``{"const": v}``, ``{"tuple": [...]}``, ``{"list": [...]}``,
``{"dict": [[key, value], ...]}`` (with ``"class"`` for a dict subclass built
from a mapping), ``{"namedtuple": cls, "items": [...]}``, ``{"dataclass": cls,
"fields": [[name, value], ...]}``, or ``{"opaque": why}``. ``cls`` is
``"module:qualname"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from .._compat.pytree import tree_leaves
from ..guards import Source
from ..runtime.output_layout import stride_orders
from .snapshot import Snapshot, Write

_MAX_DEPTH = 16


@dataclasses.dataclass(frozen=True)
class Recording:
    """What one stubbed run of the bytecode showed: the output's structure (saved with
    the artifact) and the Python state the forward writes (put back at once)."""

    structure: dict[str, Any]
    # Eager's layout of each graph output (:func:`.output_layout.stride_orders`).
    layouts: list[list[int] | None]
    writes: tuple[Write, ...] = ()
    # The stub's output i (identity) -> graph output i's example value, for the writes.
    placeholders: tuple[tuple[Any, Any], ...] = ()


def record(
    compiled_function: Any,
    graph_module: torch.fx.GraphModule,
    bound_self: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    input_sources: Sequence[str],
    grad_enabled: bool,
) -> Recording:
    """Run the bytecode once with a stub graph; the caller's objects are left as they were."""
    examples = graph_output_values(graph_module)
    layouts = stride_orders(examples)
    outputs = [_placeholder(v) for v in examples]
    _, fn, signature = _compat.compiled_function_parts(compiled_function)
    full = (bound_self, *args) if bound_self is not None else args
    closure = _compat.compiled_function_closure_locals(compiled_function)
    roots = {"model": bound_self, "closure": closure, "args": args, "kwargs": kwargs}
    snapshot = Snapshot(roots, persistent=("model", "closure"))
    try:
        with (
            torch.set_grad_enabled(grad_enabled),
            _compat.stubbed_compiled_graph(compiled_function, outputs) as calls,
        ):
            result = fn(*full, **kwargs)
    except Exception as exc:  # a recording must never fail a compile
        snapshot.restore()
        why = f"{type(exc).__name__} while recording: {exc}"[:300]
        return Recording({"value": {"opaque": why}}, layouts)
    writes = tuple(snapshot.writes())
    snapshot.restore()
    placeholders = tuple(zip(outputs, examples))
    if len(calls) != 1:
        why = f"the compiled graph ran {len(calls)} times in one call"
        return Recording({"value": {"opaque": why}}, layouts, writes, placeholders)
    flat_in = list(calls[0])
    tree = _encode(result, outputs, flat_in, 0)
    try:
        bound = signature.bind(*full, **kwargs)
        bound.apply_defaults()
        f_locals = dict(bound.arguments)
    except TypeError:
        f_locals = {}
    structure = {
        "value": tree,
        "inputs_checked": _sources_match({**closure, **f_locals}, input_sources, flat_in),
    }
    return Recording(structure, layouts, writes, placeholders)


def graph_output_values(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = tree_leaves(out.args[0])
    return [getattr(a, "meta", {}).get("example_value", a) for a in leaves]


def _placeholder(value: Any) -> Any:
    """A distinct stand-in for one graph output: an empty meta tensor of its dtype and rank."""
    if isinstance(value, torch.Tensor):
        return torch.empty((0,) * value.dim(), dtype=value.dtype, device="meta")
    if isinstance(value, (bool, int, float)) and not isinstance(value, torch.SymInt):
        return value
    return object()


def _sources_match(f_locals: dict[str, Any], sources: Sequence[str], flat_in: list[Any]) -> bool:
    """Whether each graph input's source, read from the call's locals, is what the graph got."""
    if len(sources) != len(flat_in):
        return False
    for text, passed in zip(sources, flat_in):
        source = Source.parse(text)
        if source is None or not source.is_local:
            return False
        value = source.resolve(f_locals)
        same = value is passed or (not isinstance(value, torch.Tensor) and value == passed)
        if not same:
            return False
    return True


def class_path(cls: type) -> str | None:
    """``"module:qualname"`` when ``cls`` can be imported by that name, else None."""
    module, qualname = cls.__module__, cls.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    return f"{module}:{qualname}" if found is cls else None


def _encode(value: Any, outputs: list[Any], flat_in: list[Any], depth: int) -> dict[str, Any]:
    if depth > _MAX_DEPTH:
        return {"opaque": "the output is nested too deeply"}
    if isinstance(value, torch.Tensor):
        for i, out in enumerate(outputs):
            if out is value:
                return {"out": i}
        for i, inp in enumerate(flat_in):
            if inp is value:
                return {"in": i}
        return {"opaque": "a returned tensor is neither a graph output nor a graph input"}
    if value is None or type(value) in (bool, int, str):
        return {"const": value}
    if type(value) is float:
        return {"const": value} if math.isfinite(value) else {"opaque": "a non-finite float"}

    def enc(v: Any) -> dict[str, Any]:
        return _encode(v, outputs, flat_in, depth + 1)

    if type(value) in (tuple, list):
        return {type(value).__name__: [enc(v) for v in value]}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        cls = class_path(type(value))
        if cls is None:
            return {"opaque": f"the output type {type(value).__qualname__} is not importable"}
        return {"namedtuple": cls, "items": [enc(v) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        cls = class_path(type(value))
        if cls is None or not all(f.init for f in fields):
            return {"opaque": f"the output type {type(value).__qualname__} cannot be rebuilt"}
        return {"dataclass": cls, "fields": [[f.name, enc(getattr(value, f.name))] for f in fields]}
    if isinstance(value, dict):
        if not all(type(k) in (str, int, bool) for k in value):
            return {"opaque": "a dict key is not a plain value"}
        items = [[k, enc(v)] for k, v in value.items()]
        if type(value) is dict:
            return {"dict": items}
        cls = class_path(type(value))
        init = type(value).__init__
        inherited = any(
            init is getattr(base, "__init__", None)
            for base in type(value).__mro__[1:]
            if base.__module__ in ("builtins", "collections")
        )
        if cls is None or not inherited:
            return {"opaque": f"the output type {type(value).__qualname__} cannot be rebuilt"}
        return {"dict": items, "class": cls}
    return {"opaque": f"the output holds a {type(value).__qualname__}"}
