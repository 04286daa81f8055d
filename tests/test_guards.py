"""Typed guards: one class per kind, each with its data, check, message and Python form.

The same guard objects serve the runtime's diagnosis, the file's header
(JSON round trip, and the untyped entries of format-1 files), and
``to_python()`` (the generated check raises the runtime's message).
"""

from __future__ import annotations

import pytest
import torch

from torch_precompile import GuardError
from torch_precompile.guards import (
    Call,
    Guard,
    Guards,
    Identity,
    IdentityGuard,
    RangeGuard,
    Source,
    TensorGuard,
    ValueGuard,
    identity_of,
)
from torch_precompile.runtime.pythonify import support


def _run_python_form(g: Guard, value: object) -> str | None:
    """Execute a guard's Python form with ``x`` bound to ``value``; the GuardError text or None."""
    lines = g.python(lambda _source: "x")
    assert lines is not None
    scope = {"torch": torch, "GuardError": GuardError, **vars(support), "x": value}
    try:
        exec(compile("\n".join(lines), "<guard>", "exec"), scope)
    except GuardError as exc:
        return str(exc)
    return None


def _runtime_message(g: Guard, value: object) -> str | None:
    error = g.error(Call({"x": value}, torch.is_grad_enabled(), {"s0": value.shape[0]}))  # type: ignore[union-attr]
    return None if error is None else str(error)


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(2, 3),
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 4),
        torch.zeros(3),
        torch.zeros(2, 3, requires_grad=True),
    ],
    ids=["ok", "dtype", "shape", "dims", "requires_grad"],
)
def test_tensor_guard_python_form_raises_the_runtime_message(value: torch.Tensor) -> None:
    g = TensorGuard.of("L['x']", torch.zeros(2, 3), {})
    assert _run_python_form(g, value) == _runtime_message(g, value)
    assert (value.shape == (2, 3) and value.dtype == torch.float32 and not value.requires_grad) == (
        _runtime_message(g, value) is None
    )


def test_range_guard_python_form_raises_the_runtime_message() -> None:
    g = RangeGuard("dynamo", "input 'x': dimension 0 (s0) in [2, 8]", "L['x']", 0, "s0", 2, 8)
    for size in (1, 2, 8, 9):
        value = torch.zeros(size, 3)
        assert _run_python_form(g, value) == _runtime_message(g, value)
    assert "must be in [2, 8]" in (_runtime_message(g, torch.zeros(9, 3)) or "")


def test_every_kind_round_trips_through_json(staged) -> None:
    guards = staged.artifact.guards
    again = Guards.from_json(guards.to_json())
    assert list(again) == list(guards)
    assert [type(g) for g in again] == [type(g) for g in guards]
    kinds = {g.kind for g in guards}
    assert {"tensor", "value", "global", "autograd", "system", "hooks", "index"} <= kinds


def test_untyped_entries_of_format_1_files_load_as_typed_guards() -> None:
    legacy = [
        {"phase": "dynamo", "kind": "tensor", "expr": "input 'x': float32 (2,) on cpu",
         "subject": "L['x']",
         "expected": {"dtype": "float32", "shape": [2], "device": "cpu", "requires_grad": False}},
        {"phase": "dynamo", "kind": "shape", "expr": "input 'x': dimension 0 (s0) in [2, inf]",
         "subject": "L['x']",
         "expected": {"symbol": "s0", "dim": 0, "min": 2, "max": None, "note": ""}},
        {"phase": "dynamo", "kind": "value", "expr": "input 'n' == 3", "subject": "L['n']",
         "expected": 3},
        {"phase": "dynamo", "kind": "identity", "expr": "global f is module math",
         "subject": "G['f']", "expected": {"what": "module", "name": "math", "scope": None}},
    ]  # fmt: skip
    guards = Guards.from_json(legacy)
    assert [type(g).__name__ for g in guards] == [
        "TensorGuard", "RangeGuard", "ValueGuard", "IdentityGuard",
    ]  # fmt: skip
    assert guards[1].min == 2 and guards[1].max is None
    call = Call({"x": torch.zeros(3), "n": 4}, False)
    assert "expected shape (2,)" in str(guards[0].error(call))
    assert "expected 3, got 4" in str(guards[2].error(call))


def test_source_parser_reads_what_dynamo_writes() -> None:
    s = Source.parse("L['self']._modules['blocks']._modules['0']._parameters['weight']")
    assert s is not None and s.weight() == ("parameters", "blocks.0.weight")
    assert s.describe() == "parameter 'blocks.0.weight'"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    s = Source.parse("L['self']._modules['0']._parameters['bias']")
    assert s is not None and s.resolve({"self": model}) is model[0].bias
    assert Source.parse("L['batch']['ids'][0]").describe() == "input 'batch['ids'][0]'"  # type: ignore[union-attr]
    g = Source.parse("G['__import_torch_dot_nn_dot_functional'].gelu")
    assert g is not None and g.global_name() == "torch.nn.functional.gelu"
    assert g.resolve({}) is torch.nn.functional.gelu
    assert Source.parse("not a source") is None


def test_identity_guard_names_both_sides() -> None:
    def f() -> int:
        return 1

    def other() -> int:
        return 2

    ident = identity_of(f)
    assert isinstance(ident, Identity)
    g = IdentityGuard("dynamo", f"input 'fn' is {ident}", "L['fn']", ident, None)
    assert g.error(Call({"fn": f}, False)) is None
    message = str(g.error(Call({"fn": other}, False)))
    assert "expected function" in message and "changed, capture again" in message
    assert _run_python_form(g, other) == message


def test_identity_guard_holds_for_the_same_code_installed_elsewhere() -> None:
    """The serving machine's copy of a function (another virtual environment's path)
    passes; other code under the same name does not."""
    import types

    def f(x: int) -> int:
        return x + 1

    def g(x: int) -> int:
        return x + 2

    ident = identity_of(f)
    assert ident is not None
    guard = IdentityGuard("dynamo", f"input 'fn' is {ident}", "L['fn']", ident, None)
    moved_code = f.__code__.replace(co_filename="/srv/venv/lib/site-packages/elsewhere.py")
    moved = types.FunctionType(moved_code, f.__globals__, "f")
    moved.__qualname__, moved.__module__ = f.__qualname__, f.__module__
    assert guard.error(Call({"fn": moved}, False)) is None
    assert _run_python_form(guard, moved) is None
    changed = types.FunctionType(g.__code__.replace(co_name="f"), f.__globals__, "f")
    changed.__qualname__, changed.__module__ = f.__qualname__, f.__module__
    assert "changed, capture again" in str(guard.error(Call({"fn": changed}, False)))


def test_value_guard_compares_as_recorded() -> None:
    g = ValueGuard.of("L['dims']", [1, 2])
    assert g.error(Call({"dims": (1, 2)}, False)) is None
    assert "expected (1, 2), got (1, 3)" in str(g.error(Call({"dims": [1, 3]}, False)))
