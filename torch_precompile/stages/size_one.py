"""Size 1 in every dynamic dimension: specialised variants, bundled with the dynamic one.

Dynamo specialises sizes 0 and 1 ("0/1 specialisation"), and library code
branches on a size being 1 (transformers' masks: a 1-token step is another
program), so a dynamic capture serves sizes from 2. An artifact cannot
recompile when a batch of 1 or a one-token decode step arrives, so
``Precompile.compile(dynamic=True)`` compiles, next to the dynamic variant, one
variant per combination of the dimensions that exclude 1, from the example
inputs cut to size 1 there (the other dimensions stay dynamic). The variants'
guards are disjoint, so a call runs exactly one of them.
"""

from __future__ import annotations

import copy
import itertools
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

from ..guards import RangeGuard, ShapeGuard, Source, split_size
from ..runtime.artifact import PrecompiledArtifact
from ..runtime.signature import bind_call

log = logging.getLogger("torch_precompile")

# Dimensions whose size-1 variants are combined; more would compile 2**n - 1 variants.
MAX_COMBINED = 3


def excluded_ones(artifact: PrecompiledArtifact) -> list[str]:
    """The size symbols whose recorded range starts at 2: 0/1 specialised, or 1 excluded
    by a branch (a range fixed by the model, such as a feature width, is left alone)."""
    out = []
    for g in artifact.guards.of_kind(RangeGuard):
        if g.min == 2 and (g.max is None or g.max > 2) and g.symbol not in out:
            out.append(g.symbol)
    return out


def excluded_by_a_check(artifact: PrecompiledArtifact) -> list[str]:
    """The size symbols whose range takes 1 but a shape guard ``Ne(s, 1)`` leaves it out:
    a size-oblivious capture where an operator's own check branched on size 1
    (torch 2.11's scaled_dot_product_attention on the batch; 2.13 does not)."""
    takes_one = {g.symbol for g in artifact.guards.of_kind(RangeGuard) if g.min <= 1}
    out = []
    for g in artifact.guards.of_kind(ShapeGuard):
        found = _NOT_ONE.fullmatch(g.expression.replace(" ", ""))
        if found and found.group(1) in takes_one and found.group(1) not in out:
            out.append(found.group(1))
    return out


def takes_one(artifact: PrecompiledArtifact) -> bool:
    """Whether ``artifact`` serves one row: each batch dimension's range takes 1 and no
    shape guard leaves it out."""
    left_out = set(excluded_by_a_check(artifact))
    batch = [g for g in artifact.guards.of_kind(RangeGuard) if g.dim == 0]
    return bool(batch) and all(g.min <= 1 and g.symbol not in left_out for g in batch)


_NOT_ONE = re.compile(r"Ne\((s\d+),1\)")


def cut_to_one(
    artifact: PrecompiledArtifact,
    symbols: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the example arguments with each dimension of ``symbols`` cut to size 1.

    Containers and objects (a ``DynamicCache``) are copied; other tensors are shared.
    """
    f_locals = bind_call(artifact.runtime.signature, artifact.module, args, kwargs)
    f_locals = {**artifact.runtime.closure_locals, **f_locals}
    sources = artifact.signature.symbol_sources or {}
    cut: dict[int, torch.Tensor] = {}
    for sym in symbols:
        for text in sources.get(sym, ()):
            split = split_size(text)
            source = Source.parse(split[0]) if split is not None else None
            tensor = source.resolve(f_locals) if source is not None else None
            if not isinstance(tensor, torch.Tensor) or split is None:
                continue
            current = cut.get(id(tensor), tensor)
            cut[id(tensor)] = current.narrow(split[1], 0, 1).clone(
                memory_format=torch.contiguous_format
            )
    memo: dict[int, Any] = dict(cut)
    # Tensors not cut are shared, not copied (a cache's other layers, masks).
    for leaf in _tensors((args, kwargs)):
        memo.setdefault(id(leaf), leaf)
    if artifact.module is not None:
        memo[id(artifact.module)] = artifact.module
    new_args, new_kwargs = copy.deepcopy((args, kwargs), memo)
    return new_args, new_kwargs


def _tensors(root: Any) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through containers and object attributes."""
    out, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            stack.extend(vars(obj).values())
    return out


def with_size_one(
    artifact: PrecompiledArtifact,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    build: Callable[[tuple[Any, ...], dict[str, Any]], PrecompiledArtifact],
) -> list[PrecompiledArtifact]:
    """``artifact`` followed by one variant per combination of dimensions cut to 1."""
    symbols = excluded_ones(artifact)
    if not symbols:
        return [artifact]
    if len(symbols) > MAX_COMBINED:
        log.warning(
            "precompile: %d dynamic dimensions leave out size 1; compiling size-1 variants for "
            "each alone and all together, not every combination",
            len(symbols),
        )
        combos = [(s,) for s in symbols] + [tuple(symbols)]
    else:
        combos = [c for n in range(1, len(symbols) + 1) for c in itertools.combinations(symbols, n)]
    out = [artifact]
    for combo in combos:
        names = ", ".join(_describe(artifact, s) for s in combo)
        log.info("precompile: compiling the variant for size 1 in %s", names)
        cut_args, cut_kwargs = cut_to_one(artifact, combo, args, kwargs)
        out.append(build(cut_args, cut_kwargs))
    return out


def _describe(artifact: PrecompiledArtifact, symbol: str) -> str:
    for g in artifact.guards.of_kind(RangeGuard):
        if g.symbol == symbol:
            return f"{g.source} dim {g.dim}"
    return symbol
