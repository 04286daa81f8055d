"""The Precompile facade exists and exposes every stage."""

from __future__ import annotations

import inspect

import torch

import torch_precompile
from torch_precompile import Precompile

STAGES = ("dynamo", "aot_autograd", "inductor", "precompile", "save", "load", "compile")


def test_every_stage_is_a_callable_static_method() -> None:
    for name in STAGES:
        fn = getattr(Precompile, name)
        assert callable(fn), name
        assert isinstance(inspect.getattr_static(Precompile, name), staticmethod), name


def test_stage_signatures_match_the_spec() -> None:
    dynamo_params = inspect.signature(Precompile.dynamo).parameters
    assert list(dynamo_params)[:4] == [
        "model",
        "example_inputs",
        "example_kwargs",
        "dynamic",
    ]
    # Extensions (size_oblivious) are keyword-only with defaults: the SPEC's calls still work.
    for extra in list(dynamo_params.values())[4:]:
        assert (
            extra.kind is inspect.Parameter.KEYWORD_ONLY
            and extra.default is not inspect.Parameter.empty
        )
    assert (
        inspect.signature(Precompile.dynamo).parameters["dynamic"].kind
        is inspect.Parameter.KEYWORD_ONLY
    )
    assert list(inspect.signature(Precompile.aot_autograd).parameters)[:2] == [
        "gm_or_dynamo_output",
        "guards",
    ]
    assert list(inspect.signature(Precompile.inductor).parameters)[:2] == [
        "joint_or_aot_output",
        "guards",
    ]
    save = inspect.signature(Precompile.save).parameters
    assert list(save) == ["path", "artifact", "bytecode", "guards", "sign_key"]
    load = inspect.signature(Precompile.load).parameters
    assert [name for name in load if name != "mesh"] == ["path", "model", "verify_key"]
    assert load["model"].kind is inspect.Parameter.KEYWORD_ONLY
    # The extension (a distributed artifact's mesh) is keyword-only with a default.
    assert load["mesh"].kind is inspect.Parameter.KEYWORD_ONLY and load["mesh"].default is None


def test_public_names_are_exported() -> None:
    for name in torch_precompile.__all__:
        assert hasattr(torch_precompile, name), name
    assert issubclass(torch_precompile.PrecompileError, RuntimeError)


def test_every_public_name_has_a_docstring() -> None:
    for name in torch_precompile.__all__:
        assert getattr(torch_precompile, name).__doc__, name
    for name in STAGES:
        assert getattr(Precompile, name).__doc__, name


def test_wrong_model_type_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(TypeError, match=r"model must be an nn\.Module or a callable"):
        Precompile.dynamo(42, torch.randn(2))
    with pytest.raises(TypeError, match="example_kwargs must be a dict"):
        Precompile.dynamo(torch.sin, torch.randn(2), [1])
