"""Leave the caller's objects as they were: snapshot Python state, run code, put it back.

Building an artifact runs Dynamo's bytecode once (to record the output's
structure) with a stub in place of the compiled graph. That bytecode replays
what the forward writes (``self.last = h``, a ``DynamicCache``'s new layers,
HF's ``config.problem_type``) with the stub's empty tensors. A
:class:`Snapshot` taken before records, for every object reachable from the
model and the example inputs, which values its attributes and items held;
``restore()`` puts those values (the same objects: identity is kept) back, and
``writes()`` lists what the code changed, which :mod:`._settle` uses to serve
the state a first call leaves behind.

Only Python state is walked: attribute dicts, ``__slots__``, lists, dicts and
sets. Tensor *data* is not copied: the stubbed bytecode runs no kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

log = logging.getLogger("torch_precompile")

_MISSING = object()
# Objects whose contents are not the caller's state (code, types, modules) or are
# too large to be state a forward writes (tensors are kept by identity only).
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    torch.Tensor,
    torch.dtype,
    torch.device,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
)
_LIMIT = 200_000  # objects; a bound on the walk, far above any model's module tree


@dataclasses.dataclass(frozen=True)
class Write:
    """One value the code changed: ``owner``'s ``key`` went from ``old`` to ``new``.

    ``kind`` is ``"attr"`` (an attribute), ``"item"`` (a dict or list entry)
    or ``"contents"`` (a list or set whose length changed: ``new`` is the
    whole new contents). ``path`` names it for messages (``model.config.x``).
    """

    owner: Any
    kind: str
    key: Any
    old: Any
    new: Any
    path: str
    persistent: bool


def _slots(obj: Any) -> list[str]:
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


class Snapshot:
    """The Python state reachable from ``roots`` (name -> object), as it is now.

    ``persistent`` names the roots whose state outlives a call (the model,
    closures); the others are the call's arguments.
    """

    def __init__(self, roots: dict[str, Any], persistent: Iterable[str] = ()) -> None:
        self._entries: list[tuple[Any, str, Any, str, bool]] = []
        self._seen: set[int] = set()
        keep = set(persistent)
        self.truncated = False
        for name, obj in roots.items():
            self._walk(obj, name, name in keep)
        if self.truncated:
            log.warning(
                "precompile: more than %d objects are reachable from the model and inputs; "
                "only the first %d are put back after recording the output structure",
                _LIMIT,
                _LIMIT,
            )

    def _walk(self, root: Any, path: str, persistent: bool) -> None:
        stack = [(root, path)]
        while stack:
            obj, where = stack.pop()
            if isinstance(obj, _OPAQUE) or id(obj) in self._seen:
                continue
            if len(self._seen) >= _LIMIT:
                self.truncated = True
                return
            self._seen.add(id(obj))
            children: list[tuple[Any, str]] = []
            if isinstance(obj, dict):
                self._entries.append((obj, "dict", dict(obj), where, persistent))
                children = [(v, f"{where}[{k!r}]") for k, v in obj.items()]
            elif isinstance(obj, list):
                self._entries.append((obj, "list", list(obj), where, persistent))
                children = [(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            elif isinstance(obj, tuple):
                children = [(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            elif isinstance(obj, (set, frozenset)):
                if isinstance(obj, set):
                    self._entries.append((obj, "set", set(obj), where, persistent))
            else:
                attrs = getattr(obj, "__dict__", None)
                if isinstance(attrs, dict):
                    self._entries.append((obj, "attrs", dict(attrs), where, persistent))
                    children = [(v, f"{where}.{k}") for k, v in attrs.items()]
                slots = {n: getattr(obj, n, _MISSING) for n in _slots(obj)}
                if slots:
                    self._entries.append((obj, "slots", slots, where, persistent))
                    children += [(v, f"{where}.{k}") for k, v in slots.items()]
            stack.extend(reversed(children))

    def writes(self) -> list[Write]:
        """What changed since the snapshot, one :class:`Write` per changed value."""
        out: list[Write] = []
        for obj, kind, saved, where, persistent in self._entries:
            if kind in ("attrs", "slots", "dict"):
                now = (
                    obj.__dict__
                    if kind == "attrs"
                    else obj
                    if kind == "dict"
                    else {n: getattr(obj, n, _MISSING) for n in saved}
                )
                wk = "attr" if kind != "dict" else "item"
                for key in {*saved, *now}:
                    old, new = saved.get(key, _MISSING), now.get(key, _MISSING)
                    if old is not new:
                        path = f"{where}.{key}" if wk == "attr" else f"{where}[{key!r}]"
                        out.append(Write(obj, wk, key, old, new, path, persistent))
            elif kind == "list":
                if len(obj) != len(saved):
                    out.append(Write(obj, "contents", None, saved, list(obj), where, persistent))
                else:
                    for i, (old, new) in enumerate(zip(saved, obj)):
                        if old is not new:
                            out.append(Write(obj, "item", i, old, new, f"{where}[{i}]", persistent))
            elif kind == "set" and obj != saved:
                out.append(Write(obj, "contents", None, saved, set(obj), where, persistent))
        return out

    def restore(self) -> None:
        """Put every recorded value back (the same objects, so identities hold)."""
        for obj, kind, saved, _, _ in self._entries:
            if kind == "attrs":
                if not _same(obj.__dict__, saved):
                    obj.__dict__.clear()
                    obj.__dict__.update(saved)
            elif kind == "slots":
                for name, value in saved.items():
                    if value is _MISSING:
                        if hasattr(obj, name):
                            delattr(obj, name)
                    else:
                        object.__setattr__(obj, name, value)
            elif kind == "dict":
                if not _same(obj, saved):
                    dict.clear(obj)
                    dict.update(obj, saved)
            elif kind == "list":
                list.__setitem__(obj, slice(None), saved)
            elif kind == "set":
                set.clear(obj)
                set.update(obj, saved)


def _same(now: dict[Any, Any], saved: dict[Any, Any]) -> bool:
    """Same keys holding the same objects (by identity: values may be tensors)."""
    return len(now) == len(saved) and all(now.get(k, _MISSING) is v for k, v in saved.items())


def apply(writes: Iterable[Write], values: dict[int, Any] | None = None) -> None:
    """Make each write happen (``values`` maps ``id(write)`` to a replacement new value)."""
    for w in writes:
        new = (values or {}).get(id(w), w.new)
        if w.kind == "attr":
            if new is _MISSING:
                w.owner.__dict__.pop(w.key, None)
            elif isinstance(w.owner, torch.nn.Module):
                w.owner.__dict__[w.key] = new
            else:
                object.__setattr__(w.owner, w.key, new)
        elif w.kind == "item" and isinstance(w.owner, list):
            list.__setitem__(w.owner, w.key, new)
        elif w.kind == "item":
            if new is _MISSING:
                dict.pop(w.owner, w.key, None)
            else:
                dict.__setitem__(w.owner, w.key, new)
        else:
            if isinstance(w.owner, list):
                list.__setitem__(w.owner, slice(None), new)
            else:
                set.clear(w.owner)
                set.update(w.owner, new)


@contextlib.contextmanager
def swapped_forward(model: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``model.forward`` is ``forward`` (an instance attribute);
    after it, the model's own forward (or the one its instance had) again."""
    had = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            model.forward = previous  # type: ignore[method-assign]
        else:
            del model.forward
