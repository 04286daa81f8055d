"""Guards from what PyTorch recorded: a capture's guards, its symbolic ranges,
and the save-time filter that turns unsavable guards into savable ones."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from ._base import Guard, note
from ._identity import identity_of, installed_library
from ._objects import DroppedGuard, HooksGuard, IdentityGuard
from ._shapes import RangeGuard, ShapeGuard
from ._source import MISSING, Source, describe_source, split_size
from ._values import GlobalStateGuard, TensorGuard, ValueGuard

if TYPE_CHECKING:
    from ._collection import Guards

log = logging.getLogger("torch_precompile")

_VALUE_TYPES = (bool, int, float, str, type(None), tuple, torch.dtype, torch.device)


def capture_guards(
    dynamo_guards: Sequence[Any],
    local_scope: dict[str, Any],
    shape_symbols: Mapping[str, str],
    shape_exprs: Sequence[str],
    global_state: Mapping[str, Any],
    root_is_module: bool = False,
    symbol_all_sources: Mapping[str, Sequence[str]] | None = None,
) -> list[Guard]:
    """The Dynamo stage's entries, in words.

    ``root_is_module``: the traced function is a module's ``forward``, so the
    artifact stands for calling that module, whose own hooks then count.
    ``symbol_all_sources``: every input dimension each symbol stands for (inputs
    of one size share a symbol: the attention mask the ids'), else the first.
    """
    entries: list[Guard] = []
    structure: dict[str, int] = {}
    hooked: list[str] = []
    dynamic = dynamic_dims(symbol_all_sources or {k: [v] for k, v in shape_symbols.items()})
    for g in _compat.captured_guards(dynamo_guards):
        source = Source.parse(g.source)
        local = source is not None and source.is_local
        if g.category == "tensor" and local:
            value = source.resolve(local_scope)  # type: ignore[union-attr]
            if isinstance(value, torch.Tensor):
                entries.append(TensorGuard.of(g.source, value, dynamic.get(g.source, {})))
        elif g.category == "value" and local:
            value = source.resolve(local_scope)  # type: ignore[union-attr]
            if value is not MISSING and isinstance(value, _VALUE_TYPES):
                entries.append(ValueGuard.of(g.source, value))
        elif g.category == "hook_dict":
            module = g.source.rsplit(".", 1)[0]
            if module not in hooked and not _had_hooks(module, local_scope):
                hooked.append(module)
        elif g.category == "structure":
            structure[g.detail] = structure.get(g.detail, 0) + 1
    entries.extend(GlobalStateGuard.of(k, v) for k, v in global_state.items())
    entries.extend(
        ShapeGuard("dynamo", readable_shape_expr(e, shape_symbols), e) for e in shape_exprs
    )
    if hooked or root_is_module:
        entries.append(HooksGuard.of(tuple(hooked), root_is_module))
    if structure:
        total = sum(structure.values())
        detail = ", ".join(f"{n} {k}" for k, n in sorted(structure.items(), key=lambda kv: -kv[1]))
        expr = f"{total} checks of module structure and Python objects ({detail})"
        entries.append(note("dynamo", "structure", expr))
    return entries


def _had_hooks(module: str, local_scope: dict[str, Any]) -> bool:
    """Whether the module at ``module`` had hooks at capture: Dynamo traced them into the
    graph (``parallelize_module``'s, say), so the ``hooks`` entry, which stands for
    modules called without hooks, leaves it out (the guard tree checks those hooks)."""
    source = Source.parse(module)
    value = source.resolve(local_scope) if source is not None else MISSING
    return value is not MISSING and bool(_compat.registered_hooks(value))


def dynamic_dims(symbol_sources: Mapping[str, Sequence[str]]) -> dict[str, dict[int, str]]:
    """``{"L['x']": {0: "s0"}}``: the symbol of each dynamic dimension, by tensor source."""
    out: dict[str, dict[int, str]] = {}
    for sym, sources in symbol_sources.items():
        for src in sources:
            split = split_size(src)
            if split is not None:
                out.setdefault(split[0], {}).setdefault(split[1], sym)
    return out


def readable_shape_expr(expr: str, shape_symbols: Mapping[str, str]) -> str:
    """``Ne(s0, 1)`` -> ``Ne(input 'x'.shape[0], 1)``."""

    def name(m: re.Match[str]) -> str:
        src = shape_symbols.get(m.group(0))
        split = split_size(src) if src is not None else None
        if split is None:
            return src or m.group(0)
        return f"{describe_source(split[0])}.shape[{split[1]}]"

    return re.sub(r"\bs\d+\b", name, expr)


def shape_guards(phase: str, exprs: Sequence[str], known: Guards | None = None) -> list[Guard]:
    """Symbolic-shape relations a later stage added (as Dynamo wrote them): those of
    ``exprs`` that ``known`` (the stage's input guards) does not hold yet."""
    held = {g.expression for g in known.of_kind(ShapeGuard)} if known is not None else set()
    return [ShapeGuard(phase, expr, expr) for expr in exprs if expr not in held]


def range_guards(
    ranges: Mapping[str, tuple[int, int | None]],
    sources: Mapping[str, str],
    size_oblivious: bool,
) -> list[Guard]:
    """One ``range`` entry per dynamic input dimension: the sizes the artifact serves."""
    out: list[Guard] = []
    for sym, src in sorted(sources.items(), key=lambda kv: kv[1]):
        split = split_size(src)
        if split is None or sym not in ranges:
            continue
        lo, hi = ranges[sym]
        tensor, dim = split
        note_text = ""
        if lo >= 2 and not size_oblivious:
            note_text = (
                " (0/1 are specialised: Precompile.compile(..., dynamic=True) adds a "
                "variant for size 1 (size_one=True, the default); or capture with "
                "torch._dynamo.mark_dynamic(t, dim, min=1) or size_oblivious=True)"
            )
        elif lo >= 2:
            note_text = (
                f" (sizes below {lo} were excluded while capturing or compiling: "
                "see the shape guards)"
            )
        hi_text = "inf" if hi is None else str(hi)
        expr = f"{describe_source(tensor)}: dimension {dim} ({sym}) in [{lo}, {hi_text}]{note_text}"
        out.append(RangeGuard("dynamo", expr, tensor, dim, sym, lo, hi, note_text))
    return out


def requires_grad_note(sources: Sequence[str], scope: dict[str, Any], training: bool) -> Guard:
    """Which inputs gradients flow to (a statement: the tensor guards check it)."""
    names = []
    for text in sources:
        source = Source.parse(text)
        value = source.resolve(scope) if source is not None else MISSING
        if isinstance(value, torch.Tensor) and value.requires_grad:
            names.append(describe_source(text))
    if not training:
        expr = "no gradients are computed"
    elif len(names) > 6:
        expr = f"gradients flow to {len(names)} inputs: {', '.join(names[:6])}, ..."
    else:
        expr = f"gradients flow to: {', '.join(names) or 'nothing'}"
    return note("aot_autograd", "requires_grad", expr)


# ----------------------------------------------------------- the save filter


def identity_guard(
    source: str, value: Any, scope_module: str | None, closure_names: Sequence[str] = ()
) -> IdentityGuard | None:
    """A savable replacement for a guard on an object's identity, or None."""
    parsed = Source.parse(source)
    ident = identity_of(value)
    if parsed is None or ident is None:
        return None
    where = parsed.describe()
    if parsed.is_local and parsed.root in closure_names:
        where = where.replace("input '", "closure variable '", 1)
    module = parsed.module(scope_module)
    library = installed_library(module) if module else None
    return IdentityGuard("dynamo", f"{where} is {ident}", source, ident, scope_module, library)


def source_is_rechecked(name: str, is_global: bool) -> bool:
    """Whether guards on a source can be re-checked, with the same meaning, after load.

    Globals of the capturing process (library registries, module-level hooks
    and caches) and class attributes read through ``type(...)`` are not: they
    are filled differently in another process, or belong to a class the
    stand-in does not have.
    """
    return not is_global and "type(" not in name


# Why a guard is not saved, by category: (short label, why that is safe).
DROP_CATEGORIES = {
    "module type": (
        "module types",
        "the artifact also runs on a stand-in without the model's class; the module's "
        "weights, attributes and structure stay guarded",
    ),
    "config type": (
        "config types",
        "the artifact also runs on a stand-in without the config's class; the config's "
        "values that the code read stay guarded",
    ),
    "class attribute": (
        "class attributes read through type()",
        "the traced bytecode and the defaults it read are saved in the artifact",
    ),
    "identity": (
        "object identities",
        "an identity of the capturing process; the attributes the compiled code read are "
        "guarded separately by value",
    ),
    "global": (
        "globals of the capturing process",
        "library registries, caches and module-level hooks differ between processes; the "
        "saved code resolves the modules it uses when loaded, with the torch version enforced",
    ),
}


def serializable_guard_filter(
    dropped: list[str],
    translated: list[Guard],
    scope_module: str | None = None,
    closure_names: Sequence[str] = (),
) -> Callable[[Sequence[Any]], list[bool]]:
    """Dynamo's guard filter: keep the guards that can be saved and re-checked elsewhere.

    Guards on object identities become savable ``identity`` entries of
    ``translated``. Guards on a module's *type* are dropped: the artifact must
    also run on a stand-in whose class cannot be imported; its weights,
    attributes and module tree stay guarded. Every other unsavable guard is
    dropped, and ``dropped`` gets ``"KIND name: category"``.
    """

    def guard_filter(entries: Sequence[Any]) -> list[bool]:
        keep = []
        for entry in entries:
            c = _compat.save_candidate(entry)
            keep.append(c.drop is None)
            if c.drop is None:
                continue
            guard = None
            if c.is_identity:
                guard = identity_guard(c.source, c.value, scope_module, closure_names)
            # Dynamo may call the filter more than once; record each guard once.
            if guard is not None:
                if all(g.subject != guard.subject for g in translated):
                    translated.append(guard)
            elif (line := f"{c.label}: {c.drop}") not in dropped:
                dropped.append(line)
        return keep

    return guard_filter


def dropped_guard(dropped: Sequence[str]) -> DroppedGuard:
    """One entry recording the guards not re-checked after load, by category.

    Logged once, in one line, at WARNING; each guard's name goes to DEBUG and
    into the entry, which ``inspect`` and ``as_text()`` show.
    """
    counts: dict[str, int] = {}
    for line in dropped:
        category = line.rpartition(": ")[2]
        counts[category] = counts.get(category, 0) + 1
    summary = ", ".join(f"{n} {DROP_CATEGORIES[c][0]}" for c, n in counts.items())
    log.warning(
        "precompile: %d guards are not re-checked after load (%s); see them with "
        "`torch-precompile inspect FILE`, or the torch_precompile logger at DEBUG",
        len(dropped),
        summary,
    )
    log.debug(
        "precompile: guards not re-checked after load:\n%s",
        "\n".join(
            f"  {line.rpartition(': ')[0]} ({DROP_CATEGORIES[line.rpartition(': ')[2]][1]})"
            for line in dropped
        ),
    )
    expr = f"{len(dropped)} guards are not re-checked after load: {summary}"
    return DroppedGuard("dynamo", expr, tuple(dropped))
