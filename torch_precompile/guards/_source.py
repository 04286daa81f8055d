"""Sources: where a guarded value is read from, parsed once.

Dynamo names every value it guards by a *source* string: ``L['x']`` (an
argument), ``L['self']._modules['l1']._parameters['weight']`` (a weight),
``G['torch'].nn`` (a global). :class:`Source` is the one parser of those
strings; it resolves them without ``eval`` and names them in words.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import re
import sys
from typing import Any

import torch

from .._compat.contract_probes import register_probe
from .._stable import today

_ROOT = re.compile(r"([LG])\['([^']+)'\]")
_STEP = re.compile(r"\.(\w+)|\['([^']*)'\]|\[(-?\d+)\]")
_SIZE = re.compile(r"(.*)\.size\(\)\[(\d+)\]")
_ITEM = re.compile(r"\[(?:'([^']*)'|(-?\d+))\]")
MODULE_TABLES = ("_modules", "_parameters", "_buffers")
"""nn.Module's tables in Dynamo's sources: ``L['self']._modules['l1']._parameters['w']``."""
_MODULE_ITEM = re.compile(rf"\.(?:{'|'.join(MODULE_TABLES)})\['([^']*)'\]")

ROOT_SOURCE = "L['self']"


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


MISSING: Any = _Sentinel("MISSING")
"""Resolving a source found nothing there (an absent argument, key or attribute)."""

UNRESOLVED: Any = _Sentinel("UNRESOLVED")
"""The source names a global this process does not have (so it was not read here)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A parsed Dynamo source: scope (``L`` locals, ``G`` globals), root name, steps.

    Each step is ``("attr", name)`` or ``("item", key)`` with a str or int key.
    """

    scope: str
    root: str
    steps: tuple[tuple[str, str | int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Source | None:
        """``L['self'].config.x`` -> ``Source('L', 'self', (('attr', 'config'), ('attr', 'x')))``.

        None for a string that is not a source of a local or global.
        """
        m = _ROOT.match(text)
        if not m:
            return None
        steps: list[tuple[str, str | int]] = []
        pos = m.end()
        while pos < len(text):
            mm = _STEP.match(text, pos)
            if not mm:
                return None
            if mm.group(1) is not None:
                steps.append(("attr", mm.group(1)))
            elif mm.group(2) is not None:
                steps.append(("item", mm.group(2)))
            else:
                steps.append(("item", int(mm.group(3))))
            pos = mm.end()
        return cls(m.group(1), m.group(2), tuple(steps))

    def __str__(self) -> str:
        return f"{self.scope}[{self.root!r}]" + self.rest

    @property
    def rest(self) -> str:
        """The steps after the root, as Dynamo writes them."""
        return "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in self.steps)

    @property
    def is_local(self) -> bool:
        return self.scope == "L"

    def is_under(self, root: str) -> bool:
        """Whether this source reads argument ``root`` (``self``, ``x``)."""
        return self.scope == "L" and self.root == root

    def module(self, scope_module: str | None = None) -> str | None:
        """The module a global source is read from (None for a local or a builtin)."""
        if self.scope == "L" or self.root.startswith("__builtins_dict__"):
            return None
        if self.root.startswith("__import_"):
            return self.root[len("__import_") :].replace("_dot_", ".")
        return scope_module

    def resolve(
        self,
        f_locals: dict[str, Any],
        f_globals: dict[str, Any] | None = None,
        scope_module: str | None = None,
    ) -> Any:
        """The value this source names, :data:`MISSING` or :data:`UNRESOLVED`.

        Globals resolve in this process: in ``f_globals``, as an imported module
        (Dynamo's ``__import_torch_dot_nn``), in builtins, or in the traced
        function's module when that module is loaded here.
        """
        if self.scope == "L":
            if self.root not in f_locals:
                return MISSING
            obj = f_locals[self.root]
        elif f_globals is not None and self.root in f_globals:
            obj = f_globals[self.root]
        elif self.root.startswith("__import_"):
            try:
                module = self.root[len("__import_") :].replace("_dot_", ".")
                obj = importlib.import_module(today(module))
            except ImportError:
                return UNRESOLVED
        elif self.root.startswith("__builtins_dict__"):
            obj = builtins.__dict__
        else:
            module = sys.modules.get(scope_module or "")
            if module is None or not hasattr(module, self.root):
                return UNRESOLVED
            obj = getattr(module, self.root)
        for kind, key in self.steps:
            if kind != "attr" and isinstance(key, str) and isinstance(obj, torch.Tensor):
                return MISSING  # a tensor where a dict was captured (indexing it warns)
            try:
                obj = getattr(obj, key) if kind == "attr" else obj[key]  # type: ignore[arg-type]
            except Exception:
                return MISSING
        return obj

    def describe(self) -> str:
        """In words: ``parameter 'l1.weight'``, ``input 'batch['ids']'``, ``global torch.nn``."""
        if self.scope == "G":
            return f"global {self.global_name()}"
        rest = self.rest
        if self.root == "self":
            path = _MODULE_ITEM.sub(r".\1", rest).lstrip(".")
            kind = "attribute"
            if "._parameters[" in rest:
                kind = "parameter"
            elif "._buffers[" in rest:
                kind = "buffer"
            elif rest.endswith("]") or not rest:
                kind = "module"
            return f"{kind} '{path}'" if path else "the model"
        root = self.root
        if root == "kwargs" and self.steps and self.steps[0][0] == "item":
            # A keyword collected by ``**kwargs`` (HF forwards): named as the caller wrote it.
            root, rest = str(self.steps[0][1]), Source("L", "", self.steps[1:]).rest
        suffix = _ITEM.sub(
            lambda m: f"[{m.group(1)!r}]" if m.group(1) is not None else f"[{m.group(2)}]", rest
        )
        return f"input '{root}{suffix}'"

    def global_name(self) -> str:
        """``G['__import_torch_dot_nn'].Linear`` -> ``torch.nn.Linear``."""
        root, steps = self.root, list(self.steps)
        if root.startswith("__import_"):
            root = root[len("__import_") :].replace("_dot_", ".")
        elif root.startswith("__builtins_dict__"):
            root = "builtins"
            if steps and steps[0][0] == "item":
                root, steps = str(steps[0][1]), steps[1:]
        return root + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in steps)

    def weight(self) -> tuple[str, str] | None:
        """``("parameters", "l1.weight")`` for a parameter or buffer of the model, else None."""
        if not self.is_under("self") or len(self.steps) < 2:
            return None
        path = []
        for i in range(0, len(self.steps) - 2, 2):
            attr, item = self.steps[i], self.steps[i + 1]
            if attr != ("attr", "_modules") or item[0] != "item":
                return None
            path.append(str(item[1]))
        table, leaf = self.steps[-2], self.steps[-1]
        if len(self.steps) % 2 or table[0] != "attr" or leaf[0] != "item":
            return None
        if table[1] not in ("_parameters", "_buffers"):
            return None
        return str(table[1])[1:], ".".join([*path, str(leaf[1])])


def describe_source(text: str) -> str:
    """``L['self']._modules['l1']._parameters['weight']`` -> ``parameter 'l1.weight'``."""
    source = Source.parse(text)
    if source is None:
        return text
    return source.describe() if source.scope == "L" else text


def split_size(text: str) -> tuple[str, int] | None:
    """``L['x'].size()[1]`` (Dynamo's source of a symbolic size) -> ``("L['x']", 1)``."""
    m = _SIZE.fullmatch(text)
    return (m.group(1), int(m.group(2))) if m else None


def grammar_probe(_fullgraph_capture: Any) -> None:
    """Dynamo's guard and shape-symbol source strings of a tiny capture all parse with
    this grammar and print back the same (the contract's probe of it)."""
    import torch

    from .._compat import capture

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("scale", torch.ones(3))
            self.cfg = {"k": 2}
            self.items = [1.5]

        def forward(self, x: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
            return self.lin(x) * self.scale * self.cfg["k"] + xs[0] * self.items[0]

    x = torch.ones(4, 3)
    capture.mark_dynamic(x, 0, None, None)
    cap = capture.fullgraph_capture(Tiny(), (x, [torch.ones(4, 3)]), {}, dynamic=None)
    texts = {g.name for g in cap.guards if g.name} | set(cap.input_sources)
    sizes = [s for all_ in capture.shape_env_symbol_all_sources(cap).values() for s in all_]
    if not any(t.startswith("L['self']._modules['lin']._parameters[") for t in texts):
        raise RuntimeError(f"no guard names a submodule's weight as before: {sorted(texts)}")
    if not sizes:
        raise RuntimeError("the marked dimension has no symbol source")
    for text in sizes:
        split = split_size(text)
        if split is None:
            raise RuntimeError(f"a shape symbol's source does not parse: {text!r}")
        texts.add(split[0])
    wrong = [t for t in texts if (s := Source.parse(t)) is None or str(s) != t]
    if wrong:
        raise RuntimeError(f"guard source strings our grammar does not read: {sorted(wrong)}")


register_probe("guard source strings", grammar_probe)
