"""Lean guards' vocabulary, shared by save (the spec) and load (the check): the types a
spec names, classes found by name, the grammar of the shape guards it keeps, and the
global-state check that leaves the thread count out."""

from __future__ import annotations

import ast
import functools
import json
import types
from typing import Any

import torch

from .standin.config import find

LEAN_TYPES: dict[str, type] = {
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "NoneType": type(None),
    "torch.Size": torch.Size,
    "torch.Tensor": torch.Tensor,
    "method": types.MethodType,  # a method read off a config (MethodRead)
}


def named_class(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` names among the modules already imported (or None)."""
    return find(module, qualname, import_missing=False)


# Dynamo's shape guards (epilogue lambda guards) over input sizes, as Python
# expressions: ``1 <= L['x'].size()[0] <= 64``, ``L['a'].size()[1] == L['b'].size()[0]``.
# Only this small grammar is accepted (sizes and strides of frame locals, their
# plain attributes (ints Dynamo made symbolic), integers, arithmetic,
# ``min``/``max``, comparisons, ``and``, and ``is`` between two attribute paths
# from frame locals, for tied weights, or the object a method read off one is
# bound to); anything else means no lean guards.
_SHAPE_BINOPS = ("Add", "Sub", "Mult", "FloorDiv", "Mod")
_SHAPE_CMPOPS = ("Eq", "NotEq", "Lt", "LtE", "Gt", "GtE")


def shape_expr_ok(node: Any) -> bool:

    if isinstance(node, ast.Expression):
        return shape_expr_ok(node.body)
    if isinstance(node, ast.BoolOp):
        return isinstance(node.op, ast.And) and all(shape_expr_ok(v) for v in node.values)
    if isinstance(node, ast.Compare):
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            # Tied weights: ``L['self']._modules['a']._parameters['w'] is L['self']...``
            return all(
                _source_chain(side) or _method_self(side)
                for side in (node.left, node.comparators[0])
            )
        return all(type(op).__name__ in _SHAPE_CMPOPS for op in node.ops) and all(
            shape_expr_ok(v) for v in (node.left, *node.comparators)
        )
    if isinstance(node, ast.BinOp):
        return (
            type(node.op).__name__ in _SHAPE_BINOPS
            and shape_expr_ok(node.left)
            and shape_expr_ok(node.right)
        )
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and shape_expr_ok(node.operand)
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Call):  # min(64, L['ids'].size()[1]): a bound from a table's size
        func = node.func
        return (
            (
                (isinstance(func, ast.Name) and func.id in ("min", "max"))
                or (  # torch 2.14 writes torch.sym_max(1, s) (an int here)
                    isinstance(func, ast.Attribute)
                    and func.attr in ("sym_min", "sym_max")
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"
                )
            )
            and len(node.args) >= 2
            and not node.keywords
            and all(shape_expr_ok(a) for a in node.args)
        )
    if isinstance(node, ast.Attribute) and _source_chain(node):
        # An int read from an input (a StaticCache layer's ``max_cache_len``): Dynamo's
        # tree guards its type, and a value the comparison cannot take fails the check.
        return True
    if isinstance(node, ast.Subscript) and _source_chain(node):
        # An int argument (``L['kwargs']['logits_to_keep']``, which transformers'
        # ``generate`` passes): its type is guarded in the tree, as above.
        return True
    if isinstance(node, ast.Subscript):  # L['x'].size()[0]
        call, index = node.value, node.slice
        return (
            isinstance(index, ast.Constant)
            and type(index.value) is int
            and isinstance(call, ast.Call)
            and not call.args
            and not call.keywords
            and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("size", "stride")
            and _source_chain(call.func.value)  # L['x'], L['args'][0], L['cache'].layers[0].keys
        )
    return False


def _method_self(node: Any) -> bool:
    """``object.__getattribute__(<source>, 'name').__self__``: the object a method read
    off ``<source>`` is bound to (torch 2.11 guards a config's ``get_text_config``
    so). The lean check reads it with :class:`MethodRead` as ``object``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "__self__"):
        return False
    args = _named_call(node.value, "object", "__getattribute__", 2)
    return (
        args is not None
        and _source_chain(args[0])
        and isinstance(args[1], ast.Constant)
        and type(args[1].value) is str
    )


def _named_call(node: Any, owner: str, attr: str, nargs: int) -> list[Any] | None:
    """The arguments of ``owner.attr(...)`` with ``nargs`` positional arguments and no
    keywords, or None if ``node`` is not such a call."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == owner
        and len(node.args) == nargs
        and not node.keywords
    ):
        return list(node.args)
    return None


class MethodRead:
    """``object`` in the lean check's namespace: ``object.__getattribute__(x, name)`` as
    Python answers it, except that a config stand-in's method (a descriptor that
    would turn it into its real class, importing its library) is answered with a
    method bound to it without that (the real class's method is bound to it)."""

    @staticmethod
    def __getattribute__(obj: Any, name: str) -> Any:  # type: ignore[override]
        cls = type(obj)
        if name in getattr(cls, "__torch_precompile_methods__", ()) and name not in vars(obj):
            return types.MethodType(_unbound, obj)
        return object.__getattribute__(obj, name)


def _unbound(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise TypeError("a method read by a lean guard is not called")


def _source_chain(node: Any) -> bool:
    """``L['x']`` followed by plain attributes (or ``__dict__``) and constant subscripts."""

    while True:
        if frame_local(node):
            return True
        plain = isinstance(node, ast.Attribute) and (
            not node.attr.startswith("__")
            or node.attr in ("__dict__", "__closure__")  # a module's own dict, a hook's cells
        )
        if plain or (
            isinstance(node, ast.Subscript)
            and (
                (isinstance(node.slice, ast.Constant) and type(node.slice.value) in (str, int))
                or _dict_key(node.slice)
            )
        ):
            node = node.value
        else:
            return False


def _dict_key(node: Any) -> bool:
    """``list(dict.keys(<source>))[i]``: a hook dict's i-th key (a parallelisation hook's
    mesh, ``L['self']._modules['up']._forward_pre_hooks[list(dict.keys(...))[0]]``)."""
    if not (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and type(node.slice.value) is int
    ):
        return False
    call = node.value
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "list"
        and len(call.args) == 1
        and not call.keywords
    ):
        return False
    args = _named_call(call.args[0], "dict", "keys", 1)
    return args is not None and _source_chain(args[0])


def frame_local(node: Any) -> bool:

    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "L"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    )


@functools.lru_cache(maxsize=32)
def _state_at(state: str, threads: int) -> Any:
    """Dynamo's global-state check of ``state`` (its JSON) with the thread count ``threads``."""
    data = json.loads(state)
    data["num_threads"] = threads
    guard = torch._C._dynamo.guards.GlobalStateGuard()  # type: ignore[attr-defined]
    guard.__setstate__(json.dumps(data))
    return guard


def global_state_at_any_threads(state: str) -> bool:
    """Whether torch's global state is ``state`` (a ``GlobalStateGuard``'s JSON) in all but
    the thread count: a file whose C++ kernels size their OpenMP teams and reduction
    buffers as they run (``cpp.dynamic_threads``) serves at any ``torch.set_num_threads``."""
    return bool(_state_at(state, torch.get_num_threads()).check())
