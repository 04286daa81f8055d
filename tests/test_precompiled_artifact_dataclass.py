"""PrecompiledArtifact: frozen, callable, readable (seed TODO 5.1)."""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch

from torch_precompile import PrecompiledArtifact


def test_is_a_frozen_callable_dataclass(staged) -> None:
    art = staged.artifact
    assert isinstance(art, PrecompiledArtifact)
    assert callable(art)
    with pytest.raises(dataclasses.FrozenInstanceError):
        art.training = True  # type: ignore[misc]


def test_records_signature_system_and_timings(staged) -> None:
    art = staged.artifact
    assert art.signature["parameters"]["ids"]["tensor"] == {
        "dtype": "int64",
        "shape": [2, 32],
        "device": "cpu",
        "requires_grad": False,
    }
    assert art.system["torch"] == torch.__version__
    assert art.system["python"] == platform.python_version()
    assert art.system["cpu_isa"]
    assert {"dynamo", "aot_autograd", "inductor", "precompile"} <= set(art.timings)
    assert all(t > 0 for t in art.timings.values())
    assert art.device_type == "cpu" and art.training is False


def test_as_text_groups_guards_by_stage(staged) -> None:
    text = staged.artifact.as_text()
    for header in ("dynamo (", "aot_autograd (", "inductor ("):
        assert header in text
    assert "forward(self, ids" in text
    assert "stage timings:" in text
    assert "cpu_isa=" in text


def test_exposes_the_models_weights(staged) -> None:
    names = dict(staged.artifact.named_parameters())
    assert set(names) == set(dict(staged.model.named_parameters()))
    assert len(list(staged.artifact.buffers())) == len(list(staged.model.buffers()))
