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
recorded and keeps Inductor's own check. The check itself is
:class:`torch_precompile.guards.IndexChecks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .guards import Guard, IndexGuard, describe_source

_aten = torch.ops.aten

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


def index_guards(gm: torch.fx.GraphModule, input_sources: Sequence[str]) -> list[Guard]:
    """One ``index`` guard per graph input (not a model tensor) that the compiled
    graph uses as indices, with the range eager PyTorch accepts."""
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
    return guards
