"""A model's configuration object without importing its library.

Hugging Face models keep a configuration object (``self.config``) whose class
lives in the library: unpickling it imports most of ``transformers`` (and,
through it, ``torch._dynamo``), seconds of a start that needs none of it. The
compiled code reads plain values off the config, and its guards read the same
values (``config.return_dict``, ``config._attn_implementation``), so the
stand-in of a config is an instance of a small class made at load:

- its instance ``__dict__`` is the config's own, value for value;
- its class holds, as plain values, what the config's class answered at save
  for every other readable name (class attributes, properties, aliases such as
  GPT-2's ``hidden_size`` for ``n_embd``);
- a method (``to_dict``) is the one thing it cannot answer: reading one imports
  the real class and turns the stand-in into an instance of it, in place.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any

import torch


def is_config(value: Any) -> bool:
    """A configuration object (HF's ``self.config``): an instance of an importable,
    non-torch class that keeps its state in ``__dict__``."""
    cls = type(value)
    if isinstance(value, (torch.nn.Module, type)) or not hasattr(value, "__dict__"):
        return False
    if hasattr(cls, "__slots__") or cls.__module__ in ("builtins", "__main__"):
        return False
    if "<locals>" in cls.__qualname__ or cls.__module__.split(".")[0] == "torch":
        return False
    return find(cls.__module__, cls.__qualname__, import_missing=False) is cls


def find(module: str, qualname: str, import_missing: bool = True) -> Any:
    """The object ``module.qualname`` (importing the module if asked), or None."""
    obj: Any = sys.modules.get(module)
    if obj is None and import_missing:
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def class_level_values(config: Any) -> tuple[dict[str, Any], list[str]]:
    """What ``config`` answers beyond its instance dict: ``({name: value}, methods)``.

    Dunder names are left out; so is a name whose read raises.
    """
    own = vars(config)
    values: dict[str, Any] = {}
    methods: list[str] = []
    # Hugging Face configs also answer the names of their ``attribute_map``, which
    # ``dir`` does not list (GPT-2's ``hidden_size`` is its ``n_embd``).
    aliases = getattr(type(config), "attribute_map", None)
    aliases = [k for k in aliases if isinstance(k, str)] if isinstance(aliases, dict) else []
    for name in sorted({*dir(config), *aliases}):
        if name in own or (name.startswith("__") and name.endswith("__")):
            continue
        try:
            value = getattr(config, name)
        except Exception:
            continue
        if callable(value) and not isinstance(value, type):
            methods.append(name)
        else:
            values[name] = value
    return values, methods


class ConfigStandIn:
    """Base of the stand-in classes (see the module docstring)."""

    __torch_precompile_class__: tuple[str, str] = ("", "")
    __torch_precompile_methods__: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> Any:
        cls = type(self)
        if name not in cls.__torch_precompile_methods__:
            raise AttributeError(f"{cls.__qualname__!r} object has no attribute {name!r}")
        self.__class__ = find(*cls.__torch_precompile_class__)  # the real class, from now on
        return getattr(self, name)

    def __repr__(self) -> str:
        module, qualname = type(self).__torch_precompile_class__
        return f"<stand-in of {module}.{qualname}: {vars(self)!r}>"


def standin_class(
    module: str, qualname: str, values: dict[str, Any], methods: Iterable[str]
) -> type:
    """A stand-in class for the config class ``module.qualname``."""
    namespace = dict(values)
    namespace["__torch_precompile_class__"] = (module, qualname)
    namespace["__torch_precompile_methods__"] = frozenset(methods)
    namespace["__module__"] = __name__
    return type(qualname.rsplit(".", 1)[-1], (ConfigStandIn,), namespace)
