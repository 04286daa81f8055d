"""Precompile.dynamo: Dynamo's fullgraph capture, its guards and errors."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.fixtures.models import build_nested_fn, build_scalar_fn
from torch_precompile import CaptureError, GuardError, Precompile


def _real_inputs(out, f_locals):
    return [eval(src, {}, {"L": f_locals}) for src in out.input_sources]


def test_graph_module_computes_what_the_model_computes(staged) -> None:
    f_locals = {"self": staged.model, "ids": staged.example}
    with torch.no_grad():
        result = staged.dynamo.graph_module(*_real_inputs(staged.dynamo, f_locals))
    result = result[0] if isinstance(result, (tuple, list)) else result
    torch.testing.assert_close(result, staged.expected)


def test_guards_record_shape_dtype_and_global_state(staged) -> None:
    guards = staged.dynamo.guards.by_phase("dynamo")
    text = str(guards)
    assert "input 'ids': int64 (2, 32) on cpu" in text
    assert "parameter 'tok_emb.weight': float32 (1000, 256) on cpu" in text
    assert "grad mode == False" in text
    assert "default dtype == float32" in text
    assert all(g.phase == "dynamo" for g in guards)


def test_keyword_arguments_and_python_scalars_are_captured() -> None:
    fn, args, kwargs = build_nested_fn()
    out = Precompile.dynamo(fn, args, kwargs)
    assert any(s == "L['bias']" for s in out.input_sources)
    fn2, args2, _ = build_scalar_fn()
    out2 = Precompile.dynamo(fn2, args2)
    # Python scalars are specialised: guarded, not graph inputs.
    assert "input 'alpha' == 0.5" in str(out2.guards)
    assert "input 'flag' == True" in str(out2.guards)


def test_a_single_tensor_is_one_argument_and_a_tuple_is_the_argument_list() -> None:
    out = Precompile.dynamo(lambda x: x.sin() * 2, torch.randn(3))
    assert [s for s in out.input_sources] == ["L['x']"]
    out = Precompile.dynamo(lambda a, b: a + b, (torch.randn(3), torch.randn(3)))
    assert sorted(out.input_sources) == ["L['a']", "L['b']"]


def _breaks_the_graph(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def test_graph_break_is_a_capture_error_naming_the_user_line() -> None:
    with pytest.raises(CaptureError) as info:
        Precompile.dynamo(_breaks_the_graph, torch.randn(3))
    line = inspect.getsourcelines(_breaks_the_graph)[1] + 2
    assert f"test_precompile_dynamo.py:{line}" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_wrong_example_arguments_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="signature"):
        Precompile.dynamo(lambda x: x + 1, (torch.randn(2), torch.randn(2)))


def test_guard_error_names_input_expected_and_actual(staged) -> None:
    with torch.no_grad(), pytest.raises(GuardError) as info:
        staged.artifact(torch.randint(0, 1000, (3, 32)))
    assert str(info.value) == (
        "input 'ids': expected shape (2, 32), got (3, 32); capture with dynamic=True (or "
        "torch._dynamo.mark_dynamic on that dimension) to serve other sizes [dynamo]"
    )
    with (
        torch.no_grad(),
        pytest.raises(
            GuardError,
            match=r"input 'ids': expected dtype int64, got int32; pass a tensor of dtype int64",
        ),
    ):
        staged.artifact(staged.example.to(torch.int32))
