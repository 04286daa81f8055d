"""Lean guards, at precompile: Dynamo's guards read, by their types, into a plain spec.

The spec (a :class:`.lean.guard_schema.GuardTree`, saved in the file as its plain
form) is what :mod:`.lean.guards`
turns into a plain-Python check that runs without importing torch._dynamo; when
that check fails, Dynamo's own guard manager is rebuilt and decides. It is read
from typed objects only, never from Dynamo's debug text:

- the shape of Dynamo's C++ guard tree: each node's manager type, its accessors'
  types and its leaf guards' types (``type(leaf).__name__``);
- the Dynamo ``Source`` of each node (``LocalSource``, ``AttrSource``,
  ``DictGetItemSource``, ...), found by the source name the node was built for,
  which gives each step from a value to its child;
- the kept ``Guard`` objects (their ``create_fn`` and its arguments) and the
  state the ``CheckFunctionManager`` recorded (global state, the captured torch
  function mode stack, the default device, the tensors that must not alias,
  the shape guards' Python code);
- the live values of the capture's frame locals (``self`` and the example
  inputs), where each guard's expected value comes from: Dynamo checked that
  its guards pass on them when it built them.

It is at least as strict as Dynamo's check: a manager, accessor, source or leaf
kind not known here, or a leaf that no kept guard accounts for, means no lean
guards (the full path decides every call).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import logging
from collections.abc import Sequence
from typing import Any

from ..lean import shape_expr_ok
from ..lean.guard_schema import GuardDict, GuardNode, GuardTree, Step
from ..lean.standin.config import is_config
from . import dtensor_guards  # noqa: F401  (registers tensor parallelism's readers)
from .guard_leaves import (
    LEAF_READERS,
    MISSING,
    LeafNode,
    NoLeanGuards,
    guard_kind,
    hasattr_guard,
    read_contains,
)

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass(frozen=True)
class GuardReading:
    """What one capture's lean guards are read from (all typed, all live).

    ``guards``: the Guard objects Dynamo built its tree from (after the filter);
    ``check_fn``: Dynamo's CheckFunctionManager; ``output_graph``: the capture's
    (its guards state); ``local_scope``: the capture's frame locals.
    """

    guards: Sequence[Any]
    check_fn: Any
    output_graph: Any
    local_scope: dict[str, Any]


# --- accessors: the step from a node's value to a child's, by the accessor's type ---

_BARE_STEPS: dict[str, list[Any]] = {
    "GetGenericDictGuardAccessor": ["vars"],
    "FuncDefaultsGuardAccessor": ["attr", "__defaults__"],
    "FuncKwDefaultsGuardAccessor": ["attr", "__kwdefaults__"],
    "ClosureGuardAccessor": ["attr", "__closure__"],  # a parallelisation hook's cells
}


def _key_of(source: Any) -> Any:
    """The key a dict or sequence item accessor reads, from the child's typed source."""
    from torch._dynamo.source import (
        AttrSource,
        DefaultsSource,
        DictGetItemSource,
        GetItemSource,
    )

    if isinstance(source, (DictGetItemSource, GetItemSource)):
        if getattr(source, "index_is_slice", False):
            raise NoLeanGuards("a slice")
        key = source.index
    elif isinstance(source, AttrSource):  # an attribute read from the object's __dict__
        key = source.member
    elif isinstance(source, DefaultsSource):
        key = source.idx_key
    else:
        raise NoLeanGuards(f"an item read by a {type(source).__name__}")
    if type(key) not in (str, int):
        raise NoLeanGuards(f"a key of type {type(key).__name__}")
    return key


def _step(accessor: Any, source: Any) -> Step:
    """One accessor of the tree as a step from a value to its child: ``["local",
    name]``, ``["item", key]``, ``["attr", name]`` (``getattr``), ``["oattr", name]``
    (``object.__getattribute__``) or ``["vars"]``."""
    from torch._dynamo.source import GenericAttrSource, LocalSource

    kind = type(accessor).__name__
    if kind in _BARE_STEPS:
        return list(_BARE_STEPS[kind])
    if kind == "GetAttrGuardAccessor":
        return ["attr", str(accessor.get_attr_name())]
    if source is None:
        raise NoLeanGuards(f"{kind} to a node without a known source")
    if kind == "FrameLocalsGuardAccessor" and type(source) is LocalSource:
        return ["local", source.local_name]
    if kind == "GenericGetAttrGuardAccessor" and type(source) is GenericAttrSource:
        return ["oattr", source.member]
    if kind in ("DictGetItemGuardAccessor", "GetItemGuardAccessor"):
        return ["item", _key_of(source)]
    if kind in ("TupleGetItemGuardAccessor", "ListGetItemGuardAccessor"):
        key = _key_of(source)
        if type(key) is not int:
            raise NoLeanGuards(f"{kind} with a {type(key).__name__} index")
        return ["item", key]
    raise NoLeanGuards(f"{kind} to a {type(source).__name__}")


def _apply_step(step: Step, value: Any) -> Any:
    kind = step[0]
    if kind == "vars":
        return value.__dict__
    if kind == "attr":
        return getattr(value, step[1])
    if kind == "oattr":
        return object.__getattribute__(value, step[1])
    return value[step[1]]  # "local" or "item"


# Leaves that check only what an object is (its class, what its dict holds).
_STRUCTURAL_LEAVES = ("type", "class", "contains", "no_attr")


def _computed_view(step: Step, value: Any, sub: GuardNode) -> bool:
    """Whether ``step`` reads a property of the config ``value``'s class that builds a
    new object on each read, and the guards below it check only what that object is
    (no value read through it: those are guarded on the config itself)."""
    if not (
        step[0] in ("attr", "oattr")
        and value is not MISSING
        and is_config(value)
        and isinstance(inspect.getattr_static(type(value), step[1], None), property)
    ):
        return False
    if _apply_step(step, value) is _apply_step(step, value):
        return False
    return _structural(sub)


def _structural(node: GuardNode) -> bool:
    return (
        node.dict is None
        and all(leaf[0] in _STRUCTURAL_LEAVES for leaf in node.leaves)
        and all(_structural(child) for _, child in node.children)
    )


def _under(source: str, base: str) -> bool:
    """Whether the source name ``source`` is ``base`` or reads something off it."""
    return source == base or (source.startswith(base) and source[len(base)] in ".[")


# --- the tree ---


class _Reader:
    """Reads one guard tree, with the typed guards and the live values of a capture."""

    def __init__(self, reading: GuardReading) -> None:
        from torch._dynamo.source import AttrSource, ChainedSource, NNModuleSource

        self.guards = list(reading.guards)
        self.check_fn = reading.check_fn
        self.output_graph = reading.output_graph
        self.local_scope = reading.local_scope
        self.sources: dict[str, Any] = {}
        self.by_source: dict[str, list[Any]] = {}
        # Pairs of sources that must be one object: from DUPLICATE_INPUT guards (a
        # leaf on both, or one epilogue lambda if Dynamo's config says so) and from
        # AOTAutograd's guards (always leaves).
        self.same_object: list[tuple[str, str]] = []
        self.same_object_aot: list[tuple[str, str]] = []
        # Nodes whose value a config's property computes (see ``node``), by source.
        self.computed: set[str] = set()
        for guard in self.guards:
            kind = guard_kind(guard)
            # A HASATTR guard's leaves sit on the object's node (torch 2.11 names the
            # attribute as the guard's source).
            source, attr = (
                hasattr_guard(guard) if kind == "HASATTR" else (guard.originating_source, None)
            )
            if isinstance(source, NNModuleSource):  # the module itself: one node
                source = source.base
            if source is not None:
                self.by_source.setdefault(source.name, []).append(guard)
            if kind == "DUPLICATE_INPUT":
                other = guard.create_fn.keywords["source_b"]
                self.same_object.append((other.name, source.name))
                self._add_source(other, ChainedSource, NNModuleSource)
            if attr is not None and source is not None:
                # An attribute that exists: Dynamo reads it with an accessor (which
                # fails where it is missing) on a source of its own.
                self._add_source(AttrSource(source, attr), ChainedSource, NNModuleSource)
            self._add_source(source, ChainedSource, NNModuleSource)
        for expr in getattr(reading.output_graph, "aotautograd_guards", ()):
            a, b = getattr(expr, "input_source_a", None), getattr(expr, "input_source_b", None)
            if a is None or b is None:
                raise NoLeanGuards(f"an AOTAutograd guard {type(expr).__name__}")
            self.same_object_aot.append((a.name, b.name))

    def same_object_in_epilogue(self) -> bool:
        from torch._dynamo import config

        return bool(self.same_object) and bool(
            getattr(config, "use_lamba_guard_for_object_aliasing", False)
        )

    def same_object_leaves(self) -> list[tuple[str, str]]:
        pairs = self.same_object_aot + ([] if self.same_object_in_epilogue() else self.same_object)
        unique: dict[frozenset[str], tuple[str, str]] = {}
        for pair in pairs:
            unique.setdefault(frozenset(pair), pair)
        return list(unique.values())

    def _add_source(self, source: Any, chained: type, module: type) -> None:
        while source is not None:
            if not isinstance(source, module):  # NNModuleSource: its base's name
                self.sources.setdefault(source.name, source)
            source = source.base if isinstance(source, chained) else None

    def node(self, manager: Any, value: Any, guards: list[Any] | None = None) -> GuardNode:
        """The spec of one node; ``guards``: those whose leaves sit on it, if not
        the guards on its own source."""
        name = str(manager.get_source())
        kind = type(manager).__name__
        if guards is None:
            guards = self.by_source.get(name, [])
            if kind == "RootGuardManager":  # and the guards on the process's state
                guards = guards + self.by_source.get("", [])
        node = LeafNode(name, self.sources.get(name), value, guards, kind == "RootGuardManager")
        counts: dict[str, int] = {}
        for leaf in manager.get_leaf_guards():
            counts[type(leaf).__name__] = counts.get(type(leaf).__name__, 0) + 1
        leaves: list[list[Any]] = []
        if counts.get("DICT_CONTAINS", 0) + counts.get("SET_CONTAINS", 0):
            n = counts.pop("DICT_CONTAINS", 0) + counts.pop("SET_CONTAINS", 0)
            found = read_contains(node, n, self)
            if len(found) != n:
                raise NoLeanGuards(f"{name}: {n} contains leaves, {len(found)} guards")
            leaves.extend(found)
        for leaf_kind, n in counts.items():
            read = LEAF_READERS.get(leaf_kind)
            if read is None:
                raise NoLeanGuards(f"{name}: a {leaf_kind} guard")
            leaves.extend(read(node, n, self))
        children: list[tuple[Step, GuardNode]] = []
        if kind == "DictGuardManager":
            guarded_dict: GuardDict | None = self._dict(manager, node)
        elif kind in ("GuardManager", "RootGuardManager"):
            guarded_dict = None
        else:
            raise NoLeanGuards(kind)
        for accessor, child in zip(manager.get_accessors(), manager.get_child_managers()):
            child_name = str(child.get_source())
            try:
                step = _step(accessor, self.sources.get(child_name))
            except NoLeanGuards as exc:
                raise NoLeanGuards(f"{child_name}: {exc}") from None
            try:
                child_value = _apply_step(step, value) if value is not MISSING else MISSING
            except (KeyError, AttributeError, TypeError, IndexError):
                child_value = MISSING
            # A module's ``__dict__`` node holds the leaves of its module's
            # NOT_PRESENT_IN_GENERIC_DICT guards.
            sub = self.node(
                child,
                child_value,
                [g for g in guards if guard_kind(g) == "NOT_PRESENT_IN_GENERIC_DICT"]
                if step == ["vars"]
                else None,
            )
            if _computed_view(step, value, sub):
                # Transformers' ``config.per_layer_config`` (torch 2.11 reads it with
                # object.__getattribute__): a view the config's class builds on each
                # read. Its type and dict are facts of that class, which the stand-in
                # does not have and which is not re-checked after load.
                self.computed.add(child_name)
                continue
            if step[0] in ("attr", "oattr") and not (
                sub.leaves or sub.children or sub.dict is not None
            ):
                # Nothing is checked below the attribute (torch 2.11 reads a container's
                # ``__iter__`` this way, which a stand-in module does not have); Dynamo's
                # manager, rebuilt from the saved guards, does not check it either.
                continue
            children.append((step, sub))
        return GuardNode(name, leaves, children, guarded_dict)

    def _dict(self, manager: Any, node: LeafNode) -> GuardDict:
        value = node.need_value()
        # A config that is a dict may be its stand-in: its type is a config type, not
        # saved (the values read from it are).
        config = isinstance(value, dict) and is_config(value)
        # A module's hook dict (non-empty under parallelize_module) is an OrderedDict.
        ordered = type(value) is collections.OrderedDict
        if type(value) is not dict and not config and not ordered:
            raise NoLeanGuards(f"dict guard on {node.name}: a {type(value).__name__}")
        entries = manager.get_key_value_managers()
        if len(entries) != len(value):
            raise NoLeanGuards(f"dict guard on {node.name} covers part of the dict")
        keys, values = list(value), list(value.values())
        return GuardDict(
            len(value),
            [
                (
                    int(i),
                    self.node(k, keys[i]) if k is not None else None,
                    self.node(v, values[i]) if v is not None else None,
                )
                for i, (k, v) in sorted(entries.items())
            ],
            config,
            ordered,
        )

    def shape_guards(self, root: Any) -> list[str]:
        """Dynamo's shape guards (its Python code), checked against the lean grammar,
        and the epilogue of the tree checked to hold nothing else."""
        parts = self.check_fn.shape_code_parts
        exprs = list(parts.python_code_parts.exprs) if parts is not None else []
        for expr in exprs:
            try:
                tree = ast.parse(expr, mode="eval")
            except SyntaxError as exc:
                raise NoLeanGuards(f"shape guard {expr!r}") from exc
            if not shape_expr_ok(tree):
                raise NoLeanGuards(f"shape guard {expr!r}")
        # The epilogue holds the shape guards' lambda and (torch 2.13) one lambda
        # for the objects that must be the same: ``b is a``, in Dynamo's source
        # names (Python code Dynamo evaluates, as the shape guards are).
        epilogue = [type(g).__name__ for g in root.get_epilogue_lambda_guards()]
        allowed = (1 if exprs else 0) + (1 if self.same_object_in_epilogue() else 0)
        if self.same_object_in_epilogue():
            # That a computed view refers back to the config is, too, the class's
            # code (``per_layer_config._config is config``): not re-checked.
            aliasing = [
                f"{b} is {a}"
                for b, a in self.same_object
                if not any(_under(side, c) for side in (a, b) for c in self.computed)
            ]
            if not all(shape_expr_ok(ast.parse(e, mode="eval")) for e in aliasing):
                raise NoLeanGuards(f"object aliasing {aliasing}")
            exprs = exprs + aliasing
        if any(kind != "LAMBDA_GUARD" for kind in epilogue) or len(epilogue) > allowed:
            raise NoLeanGuards(f"epilogue guards {epilogue}")
        return exprs


def read_lean_guards(
    guards: Sequence[Any], check_fn: Any, output_graph: Any, local_scope: dict[str, Any]
) -> GuardTree | None:
    """The lean spec of a guard tree Dynamo just built (``build_guard_manager``'s
    ``read_tree``), read under the state it was built in."""
    return lean_guard_spec(GuardReading(guards, check_fn, output_graph, local_scope))


def lean_guard_spec(reading: GuardReading) -> GuardTree | None:
    """Dynamo's guard tree as the record the lean check runs, or None if it cannot."""
    try:
        reader = _Reader(reading)
        root = reading.check_fn.guard_manager.root
        node = reader.node(root, dict(reading.local_scope))  # first: it finds the computed
        return GuardTree(node, tuple(reader.shape_guards(root)))
    except Exception as exc:  # NoLeanGuards, or a guard whose value cannot be read
        log.debug("no lean guards: %s: %s", type(exc).__name__, exc, exc_info=True)
        return None
