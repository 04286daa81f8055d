"""A refused call explained by its arguments: which one differs from the capture's.

When PyTorch's guard manager refuses a call and no typed guard names the
cause, the call is compared with the example call recorded at capture (the
header's ``parameters``, by :func:`torch_precompile.runtime.signature.describe_value`):
a keyword that was not there, one that is missing, a value of another type, a
flag of another value, a tensor of another memory layout. The answer is one
line naming the argument, what the capture saw, what came and what to do.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_FLAGS = (bool, str, type(None))
"""Python values Dynamo always specialises on (numbers may be symbolic)."""

_SPECIALISED = "the artifact is specialised to"
_AGAIN = "pass what the capture passed, or compile again with this call's arguments"


def explain_arguments(
    parameters: dict[str, Any], f_locals: dict[str, Any], signature: inspect.Signature
) -> str | None:
    """Why this call's arguments differ from the capture's, or None when they agree.

    ``parameters`` holds only what the example call bound (``signature.bind``
    applies no defaults); ``f_locals`` is this call, bound with its defaults.
    """
    problems = []
    for name, param in signature.parameters.items():
        if name == "self" or (name not in f_locals and name not in parameters):
            continue
        value = f_locals.get(name, inspect.Parameter.empty)
        if param.kind is param.VAR_KEYWORD:
            problem = _keywords(parameters.get(name, {}).get("dict", {}), value or {})
        elif name in parameters:
            if value is inspect.Parameter.empty:
                desc = _short(parameters[name])
                problem = f"argument {name!r} is missing; the capture passed {desc}: pass it"
            else:
                problem = _differs(parameters[name], value, f"argument {name!r}", name)
        elif param.kind is param.VAR_POSITIONAL:
            problem = (
                f"the capture passed no positional arguments for *{name}, got {len(value)}: "
                "pass them by keyword as the capture did"
                if value
                else None
            )
        elif value is not param.default:
            problem = (
                f"argument {name!r} was not passed at capture (its default is "
                f"{param.default!r}), got {_got(value)}: leave it out, or compile again with it"
            )
        else:
            problem = None
        if problem is not None:
            problems.append(problem)
    # A keyword or type difference explains more than a flag's value: report it first.
    return min(problems, key=lambda p: _SPECIALISED in p) if problems else None


def _keywords(captured: dict[str, Any], given: dict[str, Any]) -> str | None:
    accepted = ", ".join(captured) or "none"
    for key in given:
        if key not in captured:
            return (
                f"keyword argument {key!r} was not passed at capture (this artifact takes "
                f"the keywords {accepted}): leave it out, or compile again with {key!r} in "
                "the example keyword arguments"
            )
    for key, desc in captured.items():
        if key not in given:
            return (
                f"keyword argument {key!r} is missing; the capture passed {_short(desc)}: "
                f"pass it, or compile again without it"
            )
    for key, desc in captured.items():
        problem = _differs(desc, given[key], f"keyword argument {key!r}", key)
        if problem is not None:
            return problem
    return None


def _differs(desc: dict[str, Any], value: Any, label: str, expr: str) -> str | None:
    """The first way ``value`` differs from the captured description ``desc``."""
    if "tensor" in desc:
        spec = desc["tensor"]
        if not isinstance(value, torch.Tensor):
            return f"{label}: the capture passed {_short(desc)}, got {_got(value)}; {_AGAIN}"
        if spec.get("contiguous", True) and not value.is_contiguous():
            return (
                f"{label}: a tensor with strides {tuple(value.stride())} (not contiguous); the "
                f"capture passed a contiguous one: pass {expr}.contiguous()"
            )
        return None
    if "value" in desc:
        captured = desc["value"]
        if type(value).__name__ != desc.get("type", type(captured).__name__):
            return f"{label}: the capture passed {captured!r}, got {_got(value)}; {_AGAIN}"
        if isinstance(value, _FLAGS) and value != captured:
            return (
                f"{label}: {_SPECIALISED} {captured!r}, got {value!r}: pass "
                f"{captured!r}, or compile a variant with {value!r} and bundle both with "
                "Precompile.precompile([artifact, variant])"
            )
        return None
    for kind in ("list", "tuple"):
        if kind in desc:
            items = desc[kind]
            if not isinstance(value, (list, tuple)) or len(value) != len(items):
                captured = f"a {kind} of {len(items)}"
                return f"{label}: the capture passed {captured}, got {_got(value)}; {_AGAIN}"
            for i, (d, v) in enumerate(zip(items, value)):
                problem = _differs(d, v, f"{label}[{i}]", f"{expr}[{i}]")
                if problem is not None:
                    return problem
            return None
    if "dict" in desc:
        if not isinstance(value, dict):
            return f"{label}: the capture passed a dict, got {_got(value)}; {_AGAIN}"
        for key in (*desc["dict"], *value):
            if (key in desc["dict"]) != (key in value):
                return (
                    f"{label}: the capture passed the keys {list(desc['dict'])}, got "
                    f"{list(value)}; {_AGAIN}"
                )
        for key, d in desc["dict"].items():
            problem = _differs(d, value[key], f"{label}[{key!r}]", f"{expr}[{key!r}]")
            if problem is not None:
                return problem
        return None
    cls = desc.get("dataclass") or desc.get("object")
    if cls is not None and type(value).__qualname__ != cls:
        return f"{label}: the capture passed a {cls}, got {_got(value)}; {_AGAIN}"
    return None


def _short(desc: dict[str, Any]) -> str:
    """A captured value in a few words: ``a tensor int64 (2, 7)``, ``True``, ``a list of 2``."""
    if "tensor" in desc:
        t = desc["tensor"]
        return f"a tensor {t['dtype']} {tuple(t['shape'])}"
    if "value" in desc:
        return repr(desc["value"])
    for kind in ("list", "tuple", "dict"):
        if kind in desc:
            return f"a {kind} of {len(desc[kind])}"
    return f"a {desc.get('dataclass') or desc.get('object') or 'value'}"


def _got(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
    if isinstance(value, (*_FLAGS, int, float)):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__qualname__}"
