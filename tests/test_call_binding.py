"""Binding call arguments to the captured signature (the per-call path's first step).

The runtime binds with generated code instead of ``inspect.Signature.bind``;
it must accept and reject exactly the calls ``inspect`` does, and produce the
same ``{parameter: value}`` mapping with defaults applied.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from torch_precompile import GuardError, Precompile
from torch_precompile.runtime.signature import make_binder


def plain(self, x, mask=None): ...  # type: ignore[no-untyped-def]


def everything(a, b=2, /, c=3, *rest, d, e=None, **extra): ...  # type: ignore[no-untyped-def]


def positional_only(a, /): ...  # type: ignore[no-untyped-def]


def keyword_only(*, a, b=[1]): ...  # type: ignore[no-untyped-def]  # noqa: B006


def var_positional(a, *args): ...  # type: ignore[no-untyped-def]


def nothing(): ...  # type: ignore[no-untyped-def]


CALLS: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
    (plain, ("m", 1), {}),
    (plain, ("m",), {"x": 1, "mask": 2}),
    (plain, ("m", 1, 2), {}),
    (plain, ("m",), {}),  # missing x
    (plain, ("m", 1), {"y": 2}),  # unknown keyword
    (plain, ("m", 1), {"x": 2}),  # x twice
    (everything, (1,), {"d": 4}),
    (everything, (1, 2, 3, 4, 5), {"d": 4, "z": 9}),
    (everything, (), {"a": 1, "d": 4}),  # a is positional-only
    (everything, (1, 2), {"c": 5, "d": 6, "e": 7}),
    (everything, (1, 2, 3), {}),  # missing d
    (positional_only, (1,), {}),
    (positional_only, (), {"a": 1}),
    (keyword_only, (), {"a": 1}),
    (keyword_only, (1,), {}),
    (var_positional, (1, 2, 3), {}),
    (var_positional, (1,), {}),
    (nothing, (), {}),
    (nothing, (1,), {}),
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), CALLS)
def test_binder_agrees_with_inspect(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    signature = inspect.signature(fn)
    bind = make_binder(signature)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        with pytest.raises(TypeError):
            bind(*args, **kwargs)
        return
    bound.apply_defaults()
    got = bind(*args, **kwargs)
    assert got == dict(bound.arguments)
    assert list(got) == list(bound.arguments)  # same order: guards read them by name


def test_defaults_are_the_signatures_objects() -> None:
    """A default is passed as the same object, as ``apply_defaults`` does."""
    signature = inspect.signature(keyword_only)
    default = signature.parameters["b"].default
    assert make_binder(signature)(a=1)["b"] is default


def test_artifact_rejects_a_call_its_signature_does_not_accept(staged: Any) -> None:
    """A wrong call is a ``TypeError`` naming the signature, and a right one still runs."""
    art = staged.artifact
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"captured signature \(self, ids"):
            art(staged.example, mask=None)
        with pytest.raises(TypeError, match="captured signature"):
            art()
        torch.testing.assert_close(art(ids=staged.example), staged.expected)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0, relu: bool = True) -> torch.Tensor:
        y = self.lin(x) * scale
        return torch.relu(y) if relu else y


def test_a_value_of_another_kind_is_refused_by_name() -> None:
    """A tensor where the capture passed a float, and a flag of another value: one line
    naming the argument, what the capture passed and what to do (not a guard's crash)."""
    model, x = _Scaled(), torch.randn(3, 4)
    with torch.no_grad():
        art = Precompile.compile(model, (x,), {"scale": 2.0, "relu": True})
        with pytest.raises(GuardError) as info:
            art(x, scale=torch.full((3, 4), 2.0))
        message = str(info.value)
        assert message.startswith("input 'scale': expected 2.0, got a tensor float32 (3, 4)")
        assert "capture again" in message and "\n" not in message, message
        with pytest.raises(GuardError, match=r"input 'relu': expected True, got False; Python"):
            art(x, relu=False)
        torch.testing.assert_close(art(x, scale=2.0), model(x, scale=2.0))
