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
  the real class and turns the stand-in into an instance of it, in place. The
  method is a descriptor of the stand-in class, so that a read that skips
  ``__getattr__`` finds it too (torch 2.11's guards read
  ``object.__getattribute__(config, "get_text_config")``).

A config that is a dict (diffusers' ``FrozenDict``) keeps its items too, in a
stand-in derived from the same built-in dict class. Dynamo's guard tree checks
such a dict's exact type, so its class is one per config class and process,
and the guard state saved with the artifact rebuilds the config as that
stand-in when the artifact runs on saved weights (:func:`standins_in_guards`),
as the real class when it runs on a live model.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import importlib
import logging
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def is_config(value: Any) -> bool:
    """A configuration object (HF's ``self.config``): an instance of an importable,
    non-torch class that keeps its state in ``__dict__``."""
    cls = type(value)
    if isinstance(value, (torch.nn.Module, type)) or not hasattr(value, "__dict__"):
        return False
    if hasattr(cls, "__slots__") or cls.__module__ in ("builtins", "__main__", "collections"):
        return False  # collections.OrderedDict: a module's hook dicts, not a config
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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings and no log records while reading a config's class-level names:
    reading is ours, not the user's (Hugging Face's deprecated ``torch_dtype`` and
    ``use_return_dict`` warn on each read)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


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
            with _quiet():  # a deprecated property says so on every read
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

    def __repr__(self) -> str:
        module, qualname = type(self).__torch_precompile_class__
        return f"<stand-in of {module}.{qualname}: {vars(self)!r}>"


def standin_class_values(config: ConfigStandIn) -> tuple[dict[str, Any], list[str]]:
    """What a stand-in's class answers, as :func:`class_level_values` reads off a real
    config: its class values and the real class's method names (a loaded model saved
    again carries its config as the first save did)."""
    values: dict[str, Any] = {}
    for cls in reversed(type(config).__mro__):
        if issubclass(cls, ConfigStandIn) and cls is not ConfigStandIn:
            values.update(
                (k, v)
                for k, v in vars(cls).items()
                if not (k.startswith("__") and k.endswith("__")) and not isinstance(v, _RealMethod)
            )
    return values, sorted(type(config).__torch_precompile_methods__)


class _RealMethod:
    """A method of the real config class on a stand-in class: reading it turns the
    stand-in into an instance of the real class, in place, and answers as it does."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        obj.__class__ = find(*type(obj).__torch_precompile_class__)  # from now on
        return getattr(obj, self.name)


def add_methods(cls: type, methods: Iterable[str]) -> None:
    """Give the stand-in class ``cls`` the real class's methods ``methods``."""
    names = frozenset(methods)
    cls.__torch_precompile_methods__ = names  # type: ignore[attr-defined]
    for name in names:
        setattr(cls, name, _RealMethod(name))


def standin_class(
    module: str, qualname: str, values: dict[str, Any], methods: Iterable[str]
) -> type:
    """A stand-in class for the config class ``module.qualname``."""
    namespace = dict(values)
    namespace["__torch_precompile_class__"] = (module, qualname)
    namespace["__module__"] = __name__
    cls = type(qualname.rsplit(".", 1)[-1], (ConfigStandIn,), namespace)
    add_methods(cls, methods)
    return cls


# The built-in dict classes a dict config's stand-in may derive from, by name.
_DICT_BASES: dict[str, type] = {"dict": dict, "OrderedDict": collections.OrderedDict}
_STANDINS_IN_GUARDS = contextvars.ContextVar("torch_precompile_standins", default=False)


def dict_base(cls: type) -> str | None:
    """The name of the built-in dict class a dict config class derives from, or None."""
    for base in cls.__mro__:
        for name, builtin in _DICT_BASES.items():
            if base is builtin:
                return name
    return None


@functools.cache
def dict_standin_class(module: str, qualname: str, base: str) -> type:
    """The stand-in class of the dict config class ``module.qualname`` (one per
    process; its class values are set by each stand-in built)."""
    cls = standin_class(module, qualname, {}, ())
    return type(cls.__name__, (cls, _DICT_BASES[base]), {"__module__": __name__})


@contextlib.contextmanager
def standins_in_guards() -> Iterator[None]:
    """Rebuild dict configs in a saved guard state as stand-ins (the artifact runs on
    its saved weights, whose configs are stand-ins), not as their real class."""
    token = _STANDINS_IN_GUARDS.set(True)
    try:
        yield
    finally:
        _STANDINS_IN_GUARDS.reset(token)


def rebuild_dict_config(
    module: str, qualname: str, base: str, items: list[Any], state: dict[str, Any]
) -> Any:
    """A dict config from its items and instance dict (the guard state's pickle of it)."""
    if _STANDINS_IN_GUARDS.get():
        cls = dict_standin_class(module, qualname, base)
    else:
        cls = find(module, qualname)
    obj = cls.__new__(cls)
    fill_dict(obj, base, items)
    obj.__dict__.update(state)
    return obj


def fill_dict(obj: Any, base: str, items: Iterable[tuple[Any, Any]]) -> None:
    """Set the items of a dict config through its built-in class (a frozen dict's own
    ``__setitem__`` refuses)."""
    setitem = _DICT_BASES[base].__setitem__
    for key, value in items:
        setitem(obj, key, value)


def reduce_dict_config(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """A pickle reduction of a dict config that :func:`rebuild_dict_config` inverts."""
    cls = type(obj)
    base = dict_base(cls)
    assert base is not None
    return rebuild_dict_config, (
        cls.__module__,
        cls.__qualname__,
        base,
        list(obj.items()),
        dict(vars(obj)),
    )
