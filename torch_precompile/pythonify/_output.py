"""The output's structure, and a check of the argument extraction, observed on one call.

The generator calls the artifact once on random inputs built from the
recorded input signature, recording the compiled graph's flat inputs and
outputs: each leaf of the return value maps to the graph output (or input)
it is, and the extraction lines are checked to give the inputs the graph got.
The model's buffers and the RNG state are restored afterwards.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from .. import _compat
from .._signature import example_call
from ..guards._python import literal as _literal
from .support import parts_of


@dataclasses.dataclass
class Probe:
    output: str | None  # code rebuilding the output from graph_out / argN, or None
    imports: list[str]
    why_not: str  # why the output cannot be rebuilt as plain code
    description: str  # the output's structure, in words
    extraction_checked: bool


def probe(artifact: Any, exprs: list[str | None], self_name: str | None) -> Probe:
    """Call the artifact once on random inputs, recording the compiled graph's flat in/out.

    The flat inputs check the argument extraction the module will use; the
    flat outputs say where each leaf of the return value comes from. The
    model's buffers and the RNG state are restored afterwards, so that
    generating a module leaves the model as it was.
    """
    runtime = artifact._runtime
    try:
        args, kwargs = example_call(
            runtime.signature,
            artifact.signature.get("parameters", {}),
            skip_first=self_name is not None,
        )
    except (ValueError, KeyError, TypeError) as exc:
        why = f"no example inputs can be built from the recorded signature ({exc})"
        return Probe(None, [], why, "?", False)
    model = runtime.bound_self
    buffers = (
        [(b, b.detach().clone()) for b in model.buffers()]
        if isinstance(model, torch.nn.Module)
        else []
    )
    rng = torch.random.get_rng_state()
    grad = torch.enable_grad() if artifact.training else torch.no_grad()
    try:
        with _compat.recording_compiled_graph(artifact.compiled_function) as calls, grad:
            result = artifact(*args, **kwargs)
    except Exception as exc:
        why = f"calling the artifact on random inputs failed ({type(exc).__name__}: {exc})"
        return Probe(None, [], why, "?", False)
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        torch.random.set_rng_state(rng)
    if len(calls) != 1:
        why = f"the compiled graph ran {len(calls)} times in one call"
        return Probe(None, [], why, "?", False)
    flat_in, flat_out = calls[0]
    flat_out = list(flat_out) if isinstance(flat_out, (list, tuple)) else [flat_out]
    checked = _extraction_matches(artifact, args, kwargs, exprs, list(flat_in), self_name)
    builder = _OutputBuilder(flat_out, list(flat_in), [f"arg{i}" for i in range(len(flat_in))])
    code = builder.build(result)
    if not checked:
        builder.fail("the argument extraction did not reproduce the compiled graph's inputs")
        code = None
    return Probe(code, builder.imports, builder.why_not, describe_output(result), checked)


def _extraction_matches(
    artifact: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exprs: list[str | None],
    flat_in: list[Any],
    self_name: str | None,
) -> bool:
    """Whether the module's extraction lines, run on this call, give the inputs the graph got."""
    runtime = artifact._runtime
    full = (runtime.bound_self, *args) if runtime.bound_self is not None else args
    try:
        bound = runtime.signature.bind(*full, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    parts = parts_of(artifact)
    scope = {
        "MODEL": parts.model,
        "PARAMS": parts.params,
        "BUFFERS": parts.buffers,
        "CLOSURE": parts.closure,
        "GLOBALS": parts.globals,
        **{k: v for k, v in bound.arguments.items() if k != self_name},
    }
    if len(exprs) != len(flat_in) or any(x is None for x in exprs):
        return False
    for expr, passed in zip(exprs, flat_in):
        try:
            value = eval(expr, {"__builtins__": {}}, scope)
        except Exception:
            return False
        same = value is passed or (not isinstance(value, torch.Tensor) and value == passed)
        if not same:
            return False
    return True


class _OutputBuilder:
    def __init__(self, flat_out: list[Any], flat_in: list[Any], arg_names: list[str]) -> None:
        self.flat_out = flat_out
        self.flat_in = flat_in
        self.arg_names = arg_names
        self.imports: list[str] = []
        self.why_not = ""

    def fail(self, why: str) -> None:
        if not self.why_not:
            self.why_not = why

    def build(self, value: Any) -> str | None:
        if isinstance(value, torch.Tensor):
            for i, out in enumerate(self.flat_out):
                if out is value:
                    return f"graph_out[{i}]"
            for i, inp in enumerate(self.flat_in):
                if inp is value:
                    return self.arg_names[i]
            self.fail("a returned tensor is neither a graph output nor a graph input")
            return None
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            self.fail("the output holds a symbolic size")
            return None
        if value is None or type(value) in (bool, int, float, str):
            return _literal(value)
        if type(value) in (tuple, list):
            items = [self.build(v) for v in value]
            if any(i is None for i in items):
                return None
            if type(value) is tuple:
                return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"  # type: ignore[arg-type]
            return "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
        if isinstance(value, dict):
            literal = self._dict(value)
            if literal is None:
                return None
            if type(value) is dict:
                return literal
            # A dict subclass (an HF-style ModelOutput) that a mapping constructs.
            init = type(value).__init__
            if any(
                init is getattr(base, "__init__", None)
                for base in type(value).__mro__[1:]
                if base.__module__ in ("builtins", "collections")
            ):
                cls = self._class(type(value))
                return f"{cls}({literal})" if cls else None
            self.fail(f"{type(value).__qualname__} has its own __init__")
            return None
        if isinstance(value, tuple) and hasattr(type(value), "_fields"):
            items = [self.build(v) for v in value]
            cls = self._class(type(value))
            if cls is None or any(i is None for i in items):
                return None
            return f"{cls}({', '.join(items)})"  # type: ignore[arg-type]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            if not all(f.init for f in fields):
                self.fail(f"{type(value).__qualname__} has fields outside __init__")
                return None
            parts = [(f.name, self.build(getattr(value, f.name))) for f in fields]
            cls = self._class(type(value))
            if cls is None or any(p is None for _, p in parts):
                return None
            return f"{cls}(" + ", ".join(f"{k}={v}" for k, v in parts) + ")"
        self.fail(f"the output holds a {type(value).__qualname__}")
        return None

    def _dict(self, value: dict[Any, Any]) -> str | None:
        items = []
        for k, v in value.items():
            key = _literal(k) if type(k) in (str, int, bool) else None
            item = self.build(v)
            if key is None or item is None:
                self.fail("a dict key is not a plain value") if key is None else None
                return None
            items.append(f"{key}: {item}")
        return "{" + ", ".join(items) + "}"

    def _class(self, cls: type) -> str | None:
        module, qualname = cls.__module__, cls.__qualname__
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except Exception:
            found = None
        if found is not cls or module == "__main__":
            self.fail(f"the output type {qualname} cannot be imported by name")
            return None
        line = f"import {module}"
        if line not in self.imports:
            self.imports.append(line)
        return f"{module}.{qualname}"


def describe_output(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({str(value.dtype).replace('torch.', '')}, {tuple(value.shape)})"
    if isinstance(value, dict):
        inner = ", ".join(f"{k!r}: {describe_output(v)}" for k, v in value.items())
        return f"{type(value).__name__}({{{inner}}})" if type(value) is not dict else f"{{{inner}}}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe_output(v) for v in value)
        return (
            f"{type(value).__name__}({inner})"
            if type(value) not in (tuple, list)
            else (f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(
            f"{f.name}={describe_output(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({inner})"
    return (
        repr(value)
        if value is None or isinstance(value, (bool, int, float, str))
        else type(value).__name__
    )
