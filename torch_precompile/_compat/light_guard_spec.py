"""Light guards, at save: Dynamo's guard tree read into a plain spec (lists and dicts)."""

from __future__ import annotations

import ast
import collections
import logging
import re
from typing import Any

import torch

from .._config_standin import is_config
from .dtensor_guard_spec import dtensor_leaf
from .lean import LIGHT_TYPES, frame_local, named_class, shape_expr_ok

# Light guards: Dynamo's guard tree, translated at save time into a plain-Python
# check that is at least as strict as Dynamo's (any leaf or accessor we do not
# know means no light guards). At load it runs without importing torch._dynamo;
# when it fails, Dynamo's own guard manager is built and decides.

_TENSOR_RE = re.compile(
    r"check_tensor\((?P<src>.*?), (?P<cls>\w+), (?P<keys>DispatchKeySet\([^)]*\)), "
    r"torch\.(?P<dtype>\w+), device=(?P<dev>None|\d+), requires_grad=(?P<rg>True|False), "
    r"size=\[(?P<size>[^\]]*)\], stride=\[(?P<stride>[^\]]*)\]\)"
)
_SAVED_TENSOR_HOOKS_GUARD = (
    "torch._functorch.aot_autograd.utils.top_saved_tensors_hooks ids == None"
)


class _NoLightGuards(Exception):
    """A guard the light check cannot express."""


def _code_part(leaf: Any) -> str:
    # One expression, possibly recorded once per place that needed it.
    parts = {part.split("  #", 1)[0].strip() for part in leaf.verbose_code_parts()}
    if len(parts) != 1:
        raise _NoLightGuards(f"{type(leaf).__name__} with {len(parts)} different code parts")
    return parts.pop()


def _rhs_after(text: str, op: str) -> Any:

    if op not in text:
        raise _NoLightGuards(text)
    rhs = text.rsplit(op, 1)[1].strip()
    try:
        node = ast.parse(rhs, mode="eval").body
        if (  # device(type='cuda', index=0): a StaticCache layer's device
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "device"
            and not node.args
        ):
            return torch.device(**{k.arg: ast.literal_eval(k.value) for k in node.keywords})
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, RuntimeError) as exc:  # not a literal
        raise _NoLightGuards(f"{text}: {exc}") from None


def _light_leaf(leaf: Any, value: Any, has_value: bool) -> list[Any]:
    kind = type(leaf).__name__
    if kind == "DIMENSION_DYNAMIC_MARKING_GUARD":
        attrs = []
        dynamic: list[int] | None = None
        for part in leaf.verbose_code_parts():
            m = re.match(r"hasattr\(.*, '(_dynamo_\w+)'\) == False(\s|$)", part)
            if m is not None:
                attrs.append(m.group(1))
                continue
            # A dimension marked dynamic at capture: later marks may only be a subset.
            m = re.match(
                r"\(\(getattr\(.*, '_dynamo_dynamic_indices', set\(\)\)\.issubset\("
                r"(\{[\d, ]*\}|set\(\))\)\) if hasattr\(.*, '_dynamo_dynamic_indices'\) "
                r"else True\)(\s|$)",
                part,
            )
            if m is None or dynamic is not None:
                raise _NoLightGuards(part)
            dynamic = sorted(int(x) for x in re.findall(r"\d+", m.group(1)))
        if dynamic is not None:
            return ["no_dynamic_marking", attrs, dynamic]
        return ["no_dynamic_marking", attrs]
    text = _code_part(leaf)
    dtensor = dtensor_leaf(kind, text, value, has_value)  # tensor parallelism's guards
    if dtensor is not None:
        return dtensor
    if kind == "NO_HASATTR":
        m = re.fullmatch(
            r"(?:not hasattr\(.*, '(\w+)'\))|(?:hasattr\(.*, '(\w+)'\) == False)", text
        )
        if m is None:
            raise _NoLightGuards(text)
        name = m.group(1) or m.group(2)
        if name.startswith("_dynamo_"):  # torch 2.11 spells dynamic-marking checks one per leaf
            return ["no_dynamic_marking", [name]]
        return ["no_attr", name]
    if kind == "TENSOR_MATCH":
        m = _TENSOR_RE.fullmatch(text)
        if m is None or m["cls"] not in ("Tensor", "Parameter"):
            raise _NoLightGuards(text)
        # None: a dynamic dimension (its range is an epilogue shape guard).
        size = [_dim(x) for x in m["size"].split(",") if x.strip()]
        stride = [_dim(x) for x in m["stride"].split(",") if x.strip()]
        device = None if m["dev"] == "None" else int(m["dev"])  # None: the CPU
        leaf = ["tensor", m["cls"], m["keys"], m["dtype"], m["rg"] == "True", size, stride]
        return [*leaf, device] if device is not None else leaf
    prefix = "check_no_aliasing("
    if kind == "NO_TENSOR_ALIASING" and text.startswith(prefix) and text.endswith(")"):
        return ["no_aliasing", [s.strip() for s in text[len(prefix) : -1].split(", ")]]
    if kind == "OBJECT_ALIASING":  # two sources must be one object (torch 2.14 emits it)
        sources = [s.strip() for s in text.split(" is ")]
        if len(sources) != 2 or not all(sources):
            raise _NoLightGuards(text)
        return ["same_object", sources]
    if kind == "TYPE_MATCH":
        m = re.search(r"type=<class '([\w.]+)'>", leaf.verbose_code_parts()[0])
        if m is not None and m.group(1) in LIGHT_TYPES:
            return ["type", m.group(1)]
        # Another class: checked by identity with the class of that name, which the
        # object's own module (imported, since the object exists) defines.
        if m is not None and not has_value:  # an input (a cache): its class, by the guard's id
            found = _class_of_id(m.group(1), text)
            if found is None:
                raise _NoLightGuards(f"{text}: the class cannot be found by its name")
            return ["class", *found]
        cls = type(value)
        if m is None or not has_value or f"{cls.__module__}.{cls.__qualname__}" != m.group(1):
            raise _NoLightGuards(text)
        named = named_class(cls.__module__, cls.__qualname__)
        if "<locals>" in cls.__qualname__ or named is not cls:
            raise _NoLightGuards(f"{text}: the class cannot be found by its name")
        return ["class", cls.__module__, cls.__qualname__]
    if kind == "EQUALS_MATCH":
        expected = _rhs_after(text, " == ")
        if has_value and not (type(value) is type(expected) and value == expected):
            raise _NoLightGuards(f"{text}: the saved model does not satisfy it")
        return ["equals", expected]
    if kind in ("NONE_MATCH", "TRUE_MATCH", "FALSE_MATCH"):
        return ["is", {"NONE_MATCH": None, "TRUE_MATCH": True, "FALSE_MATCH": False}[kind]]
    if kind in ("LENGTH_CHECK", "DICT_LENGTH"):
        # Dynamo writes an expected length of 0 as ``not <source>`` (module hook dicts).
        if text.startswith("not ") and " == " not in text:
            return ["len", 0]
        return ["len", int(_rhs_after(text, " == "))]
    if kind == "DICT_CONTAINS":
        m = re.fullmatch(r"(not )?___dict_contains\((.+?), .*\)", text)
        if m is None:
            raise _NoLightGuards(text)

        return ["contains", ast.literal_eval(m.group(2)), m.group(1) is None]
    if kind == "SET_CONTAINS":
        m = re.fullmatch(r"(not )?set\.__contains__\((.+?), (.*)\)", text)
        if m is None:
            raise _NoLightGuards(text)
        return ["contains", ast.literal_eval(m.group(3)), m.group(1) is None]
    if kind == "GLOBAL_STATE" and " against " in text:
        return ["global_state", text.split(" against ", 1)[1]]
    if kind == "TORCH_FUNCTION_MODE_STACK" and torch._C._len_torch_function_stack() == 0:
        # The guard passed at build time with an empty stack, so it expects an empty stack.
        return ["no_torch_function_mode"]
    if kind == "DEFAULT_DEVICE" and text.replace(" ", "") == "utils_device.CURRENT_DEVICE==None":
        return ["no_default_device"]
    if kind == "LAMBDA_GUARD" and text == _SAVED_TENSOR_HOOKS_GUARD:
        return ["no_saved_tensor_hooks"]
    raise _NoLightGuards(f"{kind}: {text}")


def _dim(text: str) -> int | None:
    text = text.strip()
    return None if text == "None" else int(text)


def _is_frame_local(node: dict[str, Any]) -> bool:
    """Whether a guard node's source is a frame local itself (``L['kwargs']``)."""
    try:
        return frame_local(ast.parse(node["source"], mode="eval").body)
    except SyntaxError:
        return False


def _shape_guards(root: Any) -> list[str]:
    """Dynamo's epilogue shape guards as checked Python expressions."""

    exprs = []
    for guard in root.get_epilogue_lambda_guards():
        if type(guard).__name__ != "LAMBDA_GUARD":
            raise _NoLightGuards(f"epilogue guard {type(guard).__name__}")
        for part in guard.verbose_code_parts():
            expr = part.split("  #", 1)[0].strip()
            try:
                tree = ast.parse(expr, mode="eval")
            except SyntaxError as exc:
                raise _NoLightGuards(f"epilogue guard {expr!r}") from exc
            if not shape_expr_ok(tree):
                raise _NoLightGuards(f"epilogue guard {expr!r}")
            exprs.append(expr)
    return exprs


# Accessors Dynamo prints without an argument, as steps.
_BARE_STEPS: dict[str, list[Any]] = {
    "GetGenericDictGuardAccessor": ["vars"],
    "FuncDefaultsGuardAccessor": ["attr", "__defaults__"],
    "FuncKwDefaultsGuardAccessor": ["attr", "__kwdefaults__"],
    "ClosureGuardAccessor": ["attr", "__closure__"],  # a parallelisation hook's cells
}


def _light_step(accessor: Any) -> list[Any]:
    """One accessor of the tree as a step from a value to its child: ``["local",
    name]``, ``["item", key]``, ``["attr", name]`` (``getattr``), ``["oattr", name]``
    (``object.__getattribute__``) or ``["vars"]``."""
    text = accessor.repr()
    if text in _BARE_STEPS:
        return list(_BARE_STEPS[text])
    m = re.fullmatch(r"(\w+)\((.*)\)", text, re.S)
    if m is None:
        raise _NoLightGuards(text)
    kind, arg = m.groups()
    if kind == "FrameLocalsGuardAccessor":
        km = re.match(r"key=('(?:[^'\\]|\\.)*')", arg)
        if km is None:
            raise _NoLightGuards(text)
        return ["local", ast.literal_eval(km.group(1))]
    if kind in ("DictGetItemGuardAccessor", "GetItemGuardAccessor"):
        key = ast.literal_eval(arg)
        if type(key) not in (str, int):
            raise _NoLightGuards(text)
        return ["item", key]
    if kind in ("TupleGetItemGuardAccessor", "ListGetItemGuardAccessor"):
        return ["item", int(arg)]
    if kind in ("GetAttrGuardAccessor", "GenericGetAttrGuardAccessor"):
        if not re.fullmatch(r"\w+", arg):
            raise _NoLightGuards(text)
        return ["attr" if kind == "GetAttrGuardAccessor" else "oattr", arg]
    raise _NoLightGuards(text)


_MISSING = object()


def _apply_step(step: list[Any], value: Any) -> Any:
    kind = step[0]
    if kind == "vars":
        return value.__dict__
    if kind == "attr":
        return getattr(value, step[1])
    if kind == "oattr":
        return object.__getattribute__(value, step[1])
    return value[step[1]]  # "local" or "item"


def _light_node(manager: Any, value: Any) -> dict[str, Any]:
    has_value = value is not _MISSING
    node: dict[str, Any] = {
        "source": manager.get_source(),
        "leaves": [_light_leaf(leaf, value, has_value) for leaf in manager.get_leaf_guards()],
        "children": [],
    }
    kind = type(manager).__name__
    if kind == "DictGuardManager":
        # A config that is a dict may be its stand-in: its type is a config type, not
        # saved (the values read from it are).
        config = has_value and isinstance(value, dict) and is_config(value)
        if not has_value and not manager.get_key_value_managers() and _is_frame_local(node):
            # ``**kwargs`` read as empty: Dynamo guards each key of a frame-local dict it
            # iterates, so a dict guard with none guards an empty dict.
            value, has_value = {}, True
        # A module's hook dict (non-empty under parallelize_module) is an OrderedDict.
        ordered = has_value and type(value) is collections.OrderedDict
        if not has_value or (type(value) is not dict and not config and not ordered):
            raise _NoLightGuards(f"dict guard on {node['source']} without its saved value")
        entries = manager.get_key_value_managers()
        if len(entries) != len(value):
            raise _NoLightGuards(f"dict guard on {node['source']} covers part of the dict")
        keys, values = list(value), list(value.values())
        node["dict"] = {
            **({"config": True} if config else {}),
            **({"ordered": True} if ordered else {}),
            "size": len(value),
            "entries": [
                [
                    int(i),
                    _light_node(k, keys[i]) if k is not None else None,
                    _light_node(v, values[i]) if v is not None else None,
                ]
                for i, (k, v) in sorted(entries.items())
            ],
        }
    elif kind not in ("GuardManager", "RootGuardManager"):
        raise _NoLightGuards(kind)
    for accessor, child in zip(manager.get_accessors(), manager.get_child_managers()):
        step = _light_step(accessor)
        try:
            child_value = _apply_step(step, value) if has_value else _MISSING
        except (KeyError, AttributeError, TypeError, IndexError):
            child_value = _MISSING
        sub = _light_node(child, child_value)
        if step[0] in ("attr", "oattr") and not (sub["leaves"] or sub["children"] or "dict" in sub):
            # Nothing is checked below the attribute (torch 2.11 reads a container's
            # ``__iter__`` this way, which a stand-in module does not have); Dynamo's
            # manager, rebuilt from the saved guards, does not check it either.
            continue
        node["children"].append([step, sub])
    return node


def _class_of_id(dotted: str, text: str) -> tuple[str, str] | None:
    """``(module, qualname)`` of the class a TYPE_MATCH guard on an input expects:
    the class named ``dotted`` in an imported module whose id is the guard's (an
    input's class is imported in the capturing process, and in any process that
    passes such an input)."""
    m = re.search(r"___check_type_id\(.*, (\d+)\)", text)
    if m is None:
        return None
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module, qualname = ".".join(parts[:i]), ".".join(parts[i:])
        cls = named_class(module, qualname)
        if isinstance(cls, type) and id(cls) == int(m.group(1)) and "<locals>" not in qualname:
            return module, qualname
    return None


def light_guard_spec(guard_manager: Any, bound_self: Any) -> dict[str, Any] | None:
    """Dynamo's guard tree as plain data the light check runs, or None if it cannot."""
    try:
        root = guard_manager.root
        shape_guards = _shape_guards(root)
        f_locals = {"self": bound_self} if bound_self is not None else {}
        spec = _light_node(root, f_locals)
        if shape_guards:
            spec["shape_guards"] = shape_guards  # absent: no dynamic shapes (older files)
        return spec
    except Exception as exc:  # _NoLightGuards, or a code part we could not parse
        logging.getLogger("torch_precompile").debug("no light guards: %s", exc)
        return None
