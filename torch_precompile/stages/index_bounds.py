"""Index inputs: a range check before the compiled call, where eager raises IndexError.

Inductor's C++ kernels check indirect indices with ``TORCH_CHECK``; inside an
OpenMP parallel region the exception cannot leave the region and the process
aborts (``terminate called ... index out of bounds``). Eager PyTorch raises
``IndexError`` instead. Which graph inputs index which dimension of what is
known from the ATen graph that Inductor compiles, so it is recorded there as
an ``index`` guard (input, allowed range, what it indexes), and each call
checks those inputs with one ``aminmax`` each before the kernels run.

An index reaches a gather-like op through value-preserving views (``view``,
``reshape``, ``unsqueeze``, ``expand``, a dtype cast...); an index computed
from an input by arithmetic, or a part of one (``slice``, ``select``), is not
recorded and keeps Inductor's own check. Positions the graph computes from
sizes (``arange(past, past + length)``, Dynamo's ``iota``, plus an offset)
are recorded as an ``extent`` guard: the largest position, a sum of input
sizes, must fit the table it indexes (a sequence past GPT-2's
``n_positions``). The check itself is :class:`torch_precompile.guards.IndexChecks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from ..guards import ExtentGuard, Guard, IndexGuard, describe_source

_aten = torch.ops.aten
_prims = torch.ops.prims

# Ops whose output holds exactly the values of their first argument.
_VALUE_PRESERVING = frozenset(
    getattr(getattr(_aten, op), overload)
    for op, overload in (
        ("view", "default"),
        ("_unsafe_view", "default"),
        ("reshape", "default"),
        ("unsqueeze", "default"),
        ("squeeze", "default"),
        ("squeeze", "dim"),
        ("squeeze", "dims"),
        ("expand", "default"),
        ("clone", "default"),
        ("permute", "default"),
        ("transpose", "int"),
        ("t", "default"),
        ("alias", "default"),
        ("detach", "default"),
        ("_to_copy", "default"),
    )
)


def _graph_input(node: Any, positions: dict[Any, int]) -> int | None:
    """The graph-input position whose values ``node`` holds unchanged, or None."""
    seen = 0
    while seen < 64:
        if node in positions:
            return positions[node]
        if getattr(node, "op", None) != "call_function" or node.target not in _VALUE_PRESERVING:
            return None
        node = node.args[0]
        seen += 1
    return None


def _size(node: Any, dim: int) -> int | None:
    val = getattr(node, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or not -val.dim() <= dim < max(val.dim(), 1):
        return None
    size = val.shape[dim]
    return size if isinstance(size, int) else None  # a symbolic size: not recorded


def _uses(gm: torch.fx.GraphModule) -> list[tuple[Any, Any, int, int, int, str]]:
    """(index node, indexed node, dim, low, high, op name) of each gather-like op."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is _aten.embedding.default:
            weight, index = n.args[0], n.args[1]
            high = _size(weight, 0)
            if high is not None:
                out.append((index, weight, 0, 0, high, "embedding"))
        elif n.target in (_aten.index_select.default, _aten.gather.default):
            src, dim, index = n.args[0], int(n.args[1]), n.args[2]
            high = _size(src, dim)
            if high is not None:
                name = "index_select" if n.target is _aten.index_select.default else "gather"
                out.append((index, src, dim, 0, high, name))
        elif n.target is _aten.index.Tensor:
            src, indices = n.args[0], n.args[1]
            for dim, index in enumerate(indices):
                val = getattr(index, "meta", {}).get("val")
                if val is None or val.dtype == torch.bool:
                    continue
                high = _size(src, dim)
                if high is not None:  # negative indices wrap, as in eager
                    out.append((index, src, dim, -high, high, "indexing"))
    return out


Linear = tuple[dict[str, int], int]  # ({symbol: coefficient}, constant)


def _linear(value: Any) -> Linear | None:
    """An int, a symbolic size or a graph node holding one, as a linear form."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        return None
    return _compat.linear_in_sizes(value)


def _plus(a: Linear, b: Linear, sign: int = 1) -> Linear:
    terms = dict(a[0])
    for sym, c in b[0].items():
        terms[sym] = terms.get(sym, 0) + sign * c
    return {k: v for k, v in terms.items() if v}, a[1] + sign * b[1]


def _largest_position(node: Any) -> Linear | None:
    """The largest value of an index computed as a run of positions (``arange``,
    ``iota``, plus or minus a size), as a linear form of sizes; None otherwise."""
    shift: Linear = ({}, 0)
    for _ in range(64):
        if getattr(node, "op", None) != "call_function":
            return None
        target, args, kwargs = node.target, node.args, node.kwargs
        if target in _VALUE_PRESERVING:
            node = args[0]
            continue
        if target in (_aten.add.Tensor, _aten.sub.Tensor) and len(args) == 2:
            other = _linear(args[1])
            if other is None:
                return None
            shift = _plus(shift, other, 1 if target is _aten.add.Tensor else -1)
            node = args[0]
            continue
        if target is _prims.iota.default:
            start, step = _linear(kwargs.get("start", 0)), kwargs.get("step", 1)
            length = _linear(args[0])
            if start is None or length is None or step != 1:
                return None
            return _plus(_plus(_plus(start, length), shift), ({}, 1), -1)
        if target in (_aten.arange.default, _aten.arange.start, _aten.arange.start_step):
            end = args[0] if target is _aten.arange.default else args[1]
            step = args[2] if target is _aten.arange.start_step else kwargs.get("step", 1)
            last = _linear(end)
            if last is None or step != 1:
                return None
            return _plus(_plus(last, shift), ({}, 1), -1)
        return None
    return None


def _size_sources(
    placeholders: Sequence[Any], input_sources: Sequence[str]
) -> dict[str, tuple[str, int]]:
    """Each size symbol with an input (not a model tensor) and dimension that holds it."""
    found: dict[str, tuple[str, int]] = {}
    for node, source in zip(placeholders, input_sources):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or source.startswith("L['self']"):
            continue
        for dim, size in enumerate(val.shape):
            form = _linear(size)
            if form is not None and form[1] == 0 and list(form[0].values()) == [1]:
                found.setdefault(next(iter(form[0])), (source, dim))
    return found


def extent_guards(gm: torch.fx.GraphModule, input_sources: Sequence[str]) -> list[Guard]:
    """One ``extent`` guard per table indexed by positions the graph computes from
    input sizes, so a call past the table's end raises IndexError before the kernels."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = {n: i for i, n in enumerate(placeholders[: len(input_sources)])}
    sizes = _size_sources(placeholders[: len(input_sources)], input_sources)
    found: dict[tuple[Any, ...], ExtentGuard] = {}
    for index, target, dim, _low, high, op in _uses(gm):
        largest = _largest_position(index)
        if largest is None or not largest[0] or not set(largest[0]) <= set(sizes):
            continue  # constant positions (checked by Inductor at compile time) or unknown
        terms = tuple((*sizes[sym], coeff) for sym, coeff in sorted(largest[0].items()))
        target_pos = positions.get(target)
        what = describe_source(input_sources[target_pos]) if target_pos is not None else "a tensor"
        use = f"{op} into dimension {dim} of {what} (size {high})"
        key = (terms, largest[1], high)
        if key in found:
            continue
        expr = (
            " + ".join(f"{c} * {describe_source(s)}.shape[{d}]" for s, d, c in terms)
            + f" + {largest[1]} < {high} (positions computed from sizes: {use}); "
            "checked at each call, IndexError otherwise"
        )
        found[key] = ExtentGuard("inductor", expr, terms, largest[1], high, (use,))
    return list(found.values())


def index_guards(gm: torch.fx.GraphModule, input_sources: Sequence[str]) -> list[Guard]:
    """One ``index`` guard per graph input (not a model tensor) that the compiled
    graph uses as indices, with the range eager PyTorch accepts; then the
    ``extent`` guards of positions computed from sizes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = {n: i for i, n in enumerate(placeholders[: len(input_sources)])}
    ranges: dict[int, dict[str, Any]] = {}
    for index, target, dim, low, high, op in _uses(gm):
        pos = _graph_input(index, positions)
        if pos is None:
            continue
        source = input_sources[pos]
        if source.startswith("L['self']"):
            continue  # a buffer of the model (position ids): not a request's data
        target_pos = positions.get(target)
        what = describe_source(input_sources[target_pos]) if target_pos is not None else "a tensor"
        use = f"{op} into dimension {dim} of {what} (size {high})"
        entry = ranges.setdefault(pos, {"min": low, "max": high, "uses": []})
        entry["min"], entry["max"] = max(entry["min"], low), min(entry["max"], high)
        if use not in entry["uses"]:
            entry["uses"].append(use)
    guards = []
    for pos, entry in sorted(ranges.items()):
        source = input_sources[pos]
        expr = (
            f"{describe_source(source)}: values in [{entry['min']}, {entry['max']}) "
            f"({'; '.join(entry['uses'])}); checked at each call, IndexError otherwise"
        )
        guard = IndexGuard(
            "inductor", expr, source, entry["min"], entry["max"], tuple(entry["uses"])
        )
        guards.append(guard)
    return guards + extent_guards(gm, input_sources)
