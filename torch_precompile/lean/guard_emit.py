"""Lean guards, at load: a guard tree written as one straight-line Python check.

:class:`Emitter` walks the tree (:class:`.guard_schema.GuardTree`) once, the way
Dynamo's guard manager walks the model and inputs, and writes the check's source
with the constants it reads and what is checked together after it (tensors,
aliasing): an :class:`.guard_schema.Emitted`, which :class:`.guards.LeanGuards` runs.
"""

from __future__ import annotations

import ast
import collections
from typing import Any

import torch

from .guard_schema import (
    Emitted,
    GuardNode,
    GuardTree,
    Leaf,
    TensorCheck,
    global_state_any_threads,
)
from .guard_types import LEAN_TYPES, shape_expr_ok
from .subclasses import DTensorSpecCheck, MeshCheck


class Emitter:
    """Writes a tree's check as Python (:class:`Emitted`): one walk of the tree."""

    def __init__(self, tree: GuardTree) -> None:
        self._alias_groups: list[list[str]] = []
        self._same_groups: list[list[str]] = []
        self._collect_alias_groups(tree.root)
        self._alias_sources = {
            src for group in self._alias_groups + self._same_groups for src in group
        }
        self._consts: dict[str, Any] = {}
        self._lines: list[str] = []
        self._n = 0
        self._tensor_checks: list[TensorCheck] = []
        self._emit_node(tree.root, "L", 1)
        for expr in tree.shape_guards:
            if not shape_expr_ok(ast.parse(expr, mode="eval")):
                raise ValueError(f"shape guard outside the lean grammar: {expr!r}")
            self._fail_unless(expr)

    def emitted(self) -> Emitted:
        body = "\n".join(self._lines)
        source = f"def lean_check(L, seen, T):\n{body}\n    return True\n"
        return Emitted(
            source, self._consts, self._tensor_checks, self._alias_groups, self._same_groups
        )

    def _collect_alias_groups(self, node: GuardNode) -> None:
        for leaf in node.leaves:
            if leaf[0] == "no_aliasing" and leaf[1] not in self._alias_groups:
                self._alias_groups.append(leaf[1])
            elif leaf[0] == "same_object" and leaf[1] not in self._same_groups:
                self._same_groups.append(leaf[1])
        subs = [child for _, child in node.children]
        for _, k, v in node.dict.entries if node.dict is not None else ():
            subs.extend(x for x in (k, v) if x is not None)
        for sub in subs:
            self._collect_alias_groups(sub)

    def _const(self, value: Any) -> str:
        name = f"k{len(self._consts)}"
        self._consts[name] = value
        return name

    def _var(self) -> str:
        self._n += 1
        return f"v{self._n}"

    def _fail_unless(self, cond: str) -> None:
        self._lines.append(f"    if not ({cond}): return False")

    def _emit_node(self, node: GuardNode, var: str, _depth: int) -> None:
        if node.source in self._alias_sources:
            self._lines.append(f"    seen[{self._const(node.source)}] = {var}")
        for leaf in node.leaves:
            self._emit_leaf(leaf, var)
        d = node.dict
        if d is not None:
            exact = "isinstance({}, dict)" if d.config else "type({}) is dict"
            if d.ordered:  # a module's hook dict
                exact = "type({}) is " + self._const(collections.OrderedDict)
            self._fail_unless(f"{exact.format(var)} and len({var}) == {int(d.size)}")
            keys, values = self._var(), self._var()
            self._lines.append(f"    {keys} = list({var}); {values} = list({var}.values())")
            for i, k, v in d.entries:
                for sub, seq in ((k, keys), (v, values)):
                    if sub is not None:
                        item = self._var()
                        self._lines.append(f"    {item} = {seq}[{int(i)}]")
                        self._emit_node(sub, item, _depth + 1)
        # Children that must be empty and hold nothing else (a module's hook dicts, a
        # dozen per module) are checked in one expression: empty means falsy for the
        # dicts Dynamo guards this way, and the walk stays cheap.
        empty = [
            step[1]
            for step, child in node.children
            if step[0] == "item" and self._only_empty(child)
        ]
        if empty:
            self._lines.append(
                "    if "
                + " or ".join(f"{var}[{self._const(key)}]" for key in empty)
                + ": return False"
            )
        for step, child in node.children:
            if step[0] == "item" and self._only_empty(child):
                continue
            item = self._var()
            if step[0] == "vars":
                self._lines.append(f"    {item} = {var}.__dict__")
            elif step[0] == "attr":
                self._lines.append(f"    {item} = getattr({var}, {self._const(str(step[1]))})")
            elif step[0] == "oattr":
                name = self._const(str(step[1]))
                self._lines.append(f"    {item} = object.__getattribute__({var}, {name})")
            else:
                self._lines.append(f"    {item} = {var}[{self._const(step[1])}]")
            self._emit_node(child, item, _depth + 1)

    def _only_empty(self, node: GuardNode) -> bool:
        """Whether ``node`` checks only that its value is empty (``len == 0``)."""
        return (
            node.leaves == [["len", 0]]
            and not node.children
            and node.dict is None
            and node.source not in self._alias_sources
        )

    def _emit_leaf(self, leaf: Leaf, v: str) -> None:
        kind = leaf[0]
        if kind == "tensor":
            _, cls, keys_text, dtype_name, requires_grad, size, stride = leaf[:7]
            device = leaf[7] if len(leaf) > 7 else None
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name}")
            self._tensor_checks.append(
                (
                    torch.nn.Parameter if cls == "Parameter" else torch.Tensor,
                    dtype,
                    bool(requires_grad),
                    tuple(None if n is None else int(n) for n in size),
                    tuple(None if n is None else int(n) for n in stride),
                    # The raw bits (an older file: the key set's repr).
                    keys_text if type(keys_text) is int else _dispatch_key_set_raw(keys_text),
                    None if device is None else int(device),
                )
            )
            self._lines.append(f"    T.append({v})")
        elif kind == "no_dynamic_marking":
            attrs = frozenset(leaf[1])
            if any(hasattr(torch.Tensor, a) or hasattr(torch.nn.Parameter, a) for a in attrs):
                raise ValueError("tensor classes define a dynamic-marking attribute")
            # Plain tensors and parameters define none of these: only the instance
            # dict can hold them (cheaper than hasattr); anything else uses hasattr.
            a, plain = self._const(attrs), self._const((torch.Tensor, torch.nn.Parameter))
            self._fail_unless(
                f"{a}.isdisjoint({v}.__dict__) if type({v}) in {plain} "
                f"else not any(hasattr({v}, x) for x in {a})"
            )
            if len(leaf) > 2:  # dimensions marked dynamic at capture
                dims = self._const(frozenset(int(d) for d in leaf[2]))
                self._fail_unless(f"{dims}.issuperset(getattr({v}, '_dynamo_dynamic_indices', ()))")
        elif kind in ("no_aliasing", "same_object"):
            pass  # checked once every value is known
        elif kind == "type":
            if leaf[1] not in LEAN_TYPES:
                raise ValueError(f"unknown lean type {leaf[1]!r}")
            self._fail_unless(f"type({v}) is {type_global(leaf[1])}")
        elif kind == "class":
            # The class of that name, looked up when checked: an instance of it
            # means its module is imported; nothing is imported here.
            module, qualname = self._const(str(leaf[1])), self._const(str(leaf[2]))
            self._fail_unless(f"named_class({module}, {qualname}) is type({v})")
        elif kind == "no_attr":
            self._fail_unless(f"not hasattr({v}, {self._const(str(leaf[1]))})")
        elif kind == "equals":
            expected = self._const(leaf[1])
            self._fail_unless(f"type({v}) is {self._const(type(leaf[1]))} and {v} == {expected}")
        elif kind == "is":
            self._fail_unless(f"{v} is {self._const(leaf[1])}")
        elif kind == "len":
            self._fail_unless(f"len({v}) == {int(leaf[1])}")
        elif kind == "contains":
            self._fail_unless(f"({self._const(leaf[1])} in {v}) is {bool(leaf[2])}")
        elif kind == "global_state" and global_state_any_threads(leaf):
            # Kernels that read the thread count as they run: the state at the call's count.
            self._fail_unless(f"global_state_at_any_threads({self._const(str(leaf[1]))})")
        elif kind == "global_state":
            guard = torch._C._dynamo.guards.GlobalStateGuard()  # type: ignore[attr-defined]
            guard.__setstate__(leaf[1])
            self._fail_unless(f"{self._const(guard)}.check()")
        elif kind == "no_torch_function_mode":
            self._fail_unless("tf_stack_len() == 0")
        elif kind == "no_default_device":
            self._fail_unless("utils_device.CURRENT_DEVICE is None")
        elif kind == "no_saved_tensor_hooks":
            self._fail_unless("top_hooks(True) is None")
        elif kind == "dtensor_spec":
            self._fail_unless(f"{self._const(DTensorSpecCheck(leaf[1]))}.ok({v})")
        elif kind == "mesh":
            self._fail_unless(f"{self._const(MeshCheck(leaf[1]))}.ok({v})")
        else:
            raise ValueError(f"unknown lean guard {kind!r}")


def type_global(name: str) -> str:
    """The check's global for ``LEAN_TYPES[name]`` (``torch.Size``: ``type_torch_Size``)."""
    return "type_" + name.replace(".", "_")


def _dispatch_key_set_raw(text: str) -> int:
    """The raw bits of a DispatchKeySet from its repr, checked to round-trip."""
    names = [n.strip() for n in text[len("DispatchKeySet(") : -1].split(",") if n.strip()]
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for name in names:
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    if repr(keys) != text:
        raise ValueError(f"cannot rebuild {text}")
    return keys.raw_repr()
