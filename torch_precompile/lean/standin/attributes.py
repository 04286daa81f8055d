"""A module attribute's value as JSON and back: plain values, paths, enums,
containers, configs (as stand-ins) and plain objects of importable classes,
shared references kept shared (a memo)."""

from __future__ import annotations

import base64
import collections
import enum
import functools
import marshal
import pathlib
import types
from typing import Any

import torch

from .config import (
    ConfigStandIn,
    add_methods,
    class_level_values,
    dict_base,
    dict_standin_class,
    fill_dict,
    find,
    is_config,
    standin_class,
    standin_class_values,
)

_PLAIN = (bool, int, float, str, type(None))
_PATHS = (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
_PATH_NAMES = [cls.__name__ for cls in _PATHS]


class Unencodable(Exception):
    """A value the skeleton cannot carry (it is left out of the stand-in)."""


def encode_value(value: Any, memo: dict[int, int], depth: int = 0) -> list[Any]:
    """A JSON form ``[tag, payload]`` of an attribute value, rebuilt by :func:`decode_value`.

    Carries what model code reads from ``self`` and its config objects:
    scalars, strings, containers of them (any key type), dtypes, devices,
    importable classes and functions, ``functools.partial`` of those, and
    objects of importable classes whose attributes are all encodable (a
    Hugging Face config, say). Raises :class:`Unencodable` otherwise.

    ``memo`` keeps identity: a mutable object met again (one config shared by
    every layer) is written as ``["same", n]``, the n-th object encoded, so the
    stand-in shares it as the model did (Dynamo guards such aliasing).
    """
    if depth > 32:
        raise Unencodable("nested too deeply")
    if isinstance(value, _PLAIN) and type(value) in _PLAIN:
        return [type(value).__name__, value]
    if id(value) in memo:
        return ["same", memo[id(value)]]
    encoded = _encode_object(value, memo, depth)
    if encoded[0] in ("seq", "map", "object", "config") and encoded[1].get("type") != "tuple":
        memo[id(value)] = len(memo)
        encoded[1]["memo"] = memo[id(value)]
    return encoded


def _encode_object(value: Any, memo: dict[int, int], depth: int) -> list[Any]:
    if type(value) in (tuple, list, set, frozenset):
        items = [encode_value(v, memo, depth + 1) for v in value]
        return ["seq", {"type": type(value).__name__, "items": items}]
    if type(value) in (dict, collections.OrderedDict):
        pairs = [
            [encode_value(k, memo, depth + 1), encode_value(v, memo, depth + 1)]
            for k, v in value.items()
        ]
        payload: dict[str, Any] = {"pairs": pairs}
        if type(value) is collections.OrderedDict:  # Dynamo guards the exact type
            payload["type"] = "OrderedDict"
        return ["map", payload]
    if type(value) in _PATHS:  # from_pretrained(Path(...)) keeps the path in the config
        return ["path", [type(value).__name__, str(value)]]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value).replace("torch.", "")]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    if isinstance(value, enum.Enum):
        return ["enum", [*_reference(type(value)), value.name]]
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return ["ref", _reference(value)]
    if isinstance(value, functools.partial):
        return [
            "partial",
            {
                "func": encode_value(value.func, memo, depth + 1),
                "args": [encode_value(v, memo, depth + 1) for v in value.args],
                "kwargs": [
                    [k, encode_value(v, memo, depth + 1)] for k, v in value.keywords.items()
                ],
            },
        ]
    standin = isinstance(value, ConfigStandIn)  # a loaded model's, saved again
    if standin or is_config(value):
        # A stand-in without the config's class (see torch_precompile.lean.standin.config).
        state = {k: encode_value(v, memo, depth + 1) for k, v in vars(value).items()}
        values, methods = standin_class_values(value) if standin else class_level_values(value)
        encoded_values = {}
        for name, v in values.items():
            trial = dict(memo)
            try:
                encoded = encode_value(v, trial, depth + 1)
            except Unencodable:
                continue
            if not _imports(encoded):  # a class or function would import its library
                encoded_values[name] = encoded
                memo.update(trial)
        payload = {
            "class": list(type(value).__torch_precompile_class__)
            if standin
            else _reference(type(value)),
            "state": state,
            "class_values": encoded_values,
            "methods": sorted(methods),
        }
        base = dict_base(type(value))
        if base is not None:  # a dict config (diffusers' FrozenDict) keeps its items
            payload["dict"] = base
            payload["items"] = [
                [encode_value(k, memo, depth + 1), encode_value(v, memo, depth + 1)]
                for k, v in value.items()
            ]
        return ["config", payload]
    raise Unencodable(type(value).__qualname__)


def _imports(encoded: Any) -> bool:
    """Whether decoding ``encoded`` imports a module (a class, function or enum)."""
    if isinstance(encoded, list):
        if len(encoded) == 2 and encoded[0] in ("ref", "enum", "partial", "object"):
            return True
        return any(_imports(e) for e in encoded)
    if isinstance(encoded, dict):
        return any(_imports(e) for e in encoded.values())
    return False


def function_by_value(value: Any, memo: dict[int, int]) -> list[Any] | None:
    """``["function", ...]``: a plain function (no closure) carried as its code, module
    and name, rebuilt without importing its module (which a guard's identity of it, by
    module, name and code, does not need); None for anything else."""
    if not isinstance(value, types.FunctionType) or value.__closure__ is not None:
        return None
    try:
        code = base64.b64encode(marshal.dumps(value.__code__)).decode()
        defaults = encode_value(value.__defaults__, memo) if value.__defaults__ else None
        kwdefaults = encode_value(value.__kwdefaults__, memo) if value.__kwdefaults__ else None
    except (ValueError, Unencodable):
        return None
    payload = {"module": value.__module__, "qualname": value.__qualname__, "code": code}
    return ["function", {**payload, "defaults": defaults, "kwdefaults": kwdefaults}]


def imported_modules(encoded: Any) -> list[str]:
    """The modules decoding ``encoded`` imports (see :func:`imported_names`)."""
    return list(dict.fromkeys(module for module, _ in imported_names(encoded)))


def imported_names(encoded: Any) -> list[tuple[str, str]]:
    """``(module, qualified name)`` of each class, function or enum decoding ``encoded``
    imports (``ref``, ``enum`` and ``object`` payloads, also inside containers, partials
    and configs' state), in order; a config's own class is not one: its stand-in
    imports it only if a method of it is called."""
    found: list[tuple[str, str]] = []
    if isinstance(encoded, list):
        tag = encoded[0] if len(encoded) == 2 else None
        if tag in ("ref", "enum") and isinstance(encoded[1], list):
            found.append((str(encoded[1][0]), str(encoded[1][1])))
        elif tag == "object" and isinstance(encoded[1], dict):
            found.append((str(encoded[1]["class"][0]), str(encoded[1]["class"][1])))
        for item in encoded:
            found += imported_names(item)
    elif isinstance(encoded, dict):
        for key, item in encoded.items():
            if key != "class":
                found += imported_names(item)
    return list(dict.fromkeys(found))


def decode_value(encoded: list[Any], memo: dict[int, Any]) -> Any:
    """Inverse of :func:`encode_value` (and of the version-1 ``[type name, value]`` form)."""
    tag, payload = encoded
    if tag == "same":
        return memo[payload]
    value = _decode_object(tag, payload, memo)
    if isinstance(payload, dict) and "memo" in payload:
        memo[payload["memo"]] = value
    return value


def _decode_object(tag: str, payload: Any, memo: dict[int, Any]) -> Any:
    if tag in ("bool", "int", "float", "str", "NoneType", "list"):
        return payload
    if tag == "tuple":  # version 1
        return _to_tuple(payload)
    if tag == "config" and "state" in payload:  # a stand-in of a config object
        if "dict" in payload:  # one class per config class: Dynamo guards its exact type
            cls = dict_standin_class(*payload["class"], payload["dict"])
            add_methods(cls, payload["methods"])
        else:
            cls = standin_class(*payload["class"], {}, payload["methods"])
        obj = cls.__new__(cls)
        memo[payload["memo"]] = obj  # before its state: the state may refer back to it
        # In the order they were encoded: a later value may refer to an earlier one.
        obj.__dict__.update({k: decode_value(v, memo) for k, v in payload["state"].items()})
        for name, value in payload["class_values"].items():
            setattr(cls, name, decode_value(value, memo))
        if "dict" in payload:  # encoded last: its values may refer to the ones above
            items = [(decode_value(k, memo), decode_value(v, memo)) for k, v in payload["items"]]
            fill_dict(obj, payload["dict"], items)
        return obj
    if tag == "config":  # version 1
        obj = _new_instance(find(payload["module"], payload["qualname"]))
        for key, (type_name, value) in payload["state"].items():
            obj.__dict__[key] = _to_tuple(value) if type_name == "tuple" else value
        return obj
    if tag == "seq":
        items = [decode_value(v, memo) for v in payload["items"]]
        return {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}[payload["type"]](
            items
        )
    if tag == "map":
        cls = collections.OrderedDict if payload.get("type") == "OrderedDict" else dict
        return cls((decode_value(k, memo), decode_value(v, memo)) for k, v in payload["pairs"])
    if tag == "path":
        return _PATHS[_PATH_NAMES.index(payload[0])](payload[1])
    if tag == "dtype":
        return getattr(torch, payload)
    if tag == "device":
        return torch.device(payload)
    if tag == "ref":
        return find(*payload)
    if tag == "enum":
        return getattr(find(*payload[:2]), payload[2])
    if tag == "function":
        from ..pickling import function_from_code

        defaults, kwdefaults = payload["defaults"], payload["kwdefaults"]
        return function_from_code(
            marshal.loads(base64.b64decode(payload["code"])),
            payload["module"],
            payload["qualname"],
            decode_value(defaults, memo) if defaults is not None else None,
            decode_value(kwdefaults, memo) if kwdefaults is not None else None,
        )
    if tag == "partial":
        return functools.partial(
            decode_value(payload["func"], memo),
            *[decode_value(v, memo) for v in payload["args"]],
            **{k: decode_value(v, memo) for k, v in payload["kwargs"]},
        )
    if tag == "object":
        obj = _new_instance(find(*payload["class"]))
        memo[payload["memo"]] = obj  # before its state: the state may refer back to it
        obj.__dict__.update({k: decode_value(v, memo) for k, v in payload["state"].items()})
        return obj
    raise ValueError(f"unknown attribute encoding {tag!r} in the artifact's module skeleton")


def _reference(obj: Any) -> list[str]:
    """``[module, qualname]`` of an object that can be imported by that name."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not isinstance(module, str) or "<locals>" in qualname or module == "__main__":
        raise Unencodable(f"{qualname} cannot be imported by name")
    if find(module, qualname, import_missing=False) is not obj:
        raise Unencodable(f"{module}.{qualname} is not importable under that name")
    return [module, qualname]


def _new_instance(cls: Any) -> Any:
    if not isinstance(cls, type):
        raise ImportError(f"the model's attribute class {cls!r} cannot be imported")
    return cls.__new__(cls)


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value
