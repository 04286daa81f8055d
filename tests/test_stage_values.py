"""A stage output is a value: a later stage can run on it more than once, and never changes it.

One ATen graph compiled with two Inductor configurations gives two working
variants that bundle into one artifact; ``aot_autograd`` twice on one
``DynamoOutput`` gives the same graph twice; the graphs, text views and
timings of earlier outputs are the same before and after the later stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.models import build_tiny_mlp, build_transformer
from torch_precompile import Precompile, PrecompiledArtifact

# A configuration that is cheap to compile and different from the default.
OTHER_CONFIG = {"max_autotune": False, "epilogue_fusion": False}


@dataclasses.dataclass
class Reused:
    model: torch.nn.Module
    ids: torch.Tensor
    expected: torch.Tensor
    dynamo: Any
    aot: Any
    aot_again: Any
    before: dict[str, Any]
    default: Any
    other: Any
    artifact_default: PrecompiledArtifact
    artifact_other: PrecompiledArtifact
    timings_before_other: dict[str, float]


@pytest.fixture(scope="module")
def reused() -> Reused:
    model, (ids,), _ = build_transformer()
    with torch.no_grad():
        expected = model(ids)
        d = Precompile.dynamo(model, ids)
        a = Precompile.aot_autograd(d)
        before = {
            "dynamo_code": d.graph_module.code,
            "dynamo_text": d.as_text(),
            "dynamo_training": d.training,
            "aot_code": a.joint_graph.code,
            "aot_text": a.as_text(),
            "aot_guards": a.guards,
        }
        a_again = Precompile.aot_autograd(d)
        default = Precompile.inductor(a)
        art_default = Precompile.precompile(default)
        timings_before_other = dict(art_default.timings)
        # The second configuration goes through the unpacked pieces of the same output.
        joint, guards = a
        other = Precompile.inductor(joint, guards, options=OTHER_CONFIG)
        art_other = Precompile.precompile(other)
    return Reused(
        model,
        ids,
        expected,
        d,
        a,
        a_again,
        before,
        default,
        other,
        art_default,
        art_other,
        timings_before_other,
    )


def test_two_inductor_configurations_of_one_aten_graph_both_match_eager(reused: Reused) -> None:
    assert reused.default.compiled is not reused.other.compiled
    with torch.no_grad():
        for artifact in (reused.artifact_default, reused.artifact_other):
            torch.testing.assert_close(artifact(reused.ids), reused.expected)
        other_ids = torch.randint(0, 1000, reused.ids.shape)
        torch.testing.assert_close(
            reused.artifact_other(other_ids), reused.model(other_ids), rtol=1e-5, atol=1e-5
        )


def test_the_two_configurations_bundle_serve_save_and_load(reused: Reused, tmp_path: Path) -> None:
    bundle = Precompile.precompile([reused.default, reused.other])
    assert len(bundle.variants) == 2
    path = tmp_path / "two_configs.pt2"
    with torch.no_grad():
        torch.testing.assert_close(bundle(reused.ids), reused.expected)
        Precompile.save(path, bundle)
        loaded = Precompile.load(path)
        assert len(loaded.variants) == 2
        torch.testing.assert_close(loaded(reused.ids), reused.expected)


def test_aot_autograd_twice_on_one_dynamo_output_gives_the_same_graph(reused: Reused) -> None:
    assert reused.aot_again is not reused.aot
    assert reused.aot_again.joint_graph is not reused.aot.joint_graph
    assert reused.aot_again.joint_graph.code == reused.aot.joint_graph.code
    assert reused.aot_again.guards == reused.aot.guards
    with torch.no_grad():
        artifact = Precompile.precompile(Precompile.inductor(reused.aot_again))
        torch.testing.assert_close(artifact(reused.ids), reused.expected)


def test_later_stages_leave_earlier_outputs_unchanged(reused: Reused) -> None:
    d, a, before = reused.dynamo, reused.aot, reused.before
    assert d.graph_module.code == before["dynamo_code"]
    assert d.as_text() == before["dynamo_text"]
    assert d.training == before["dynamo_training"]
    assert a.joint_graph.code == before["aot_code"]
    assert a.as_text() == before["aot_text"]
    assert a.guards == before["aot_guards"]
    # The Inductor stage added its guards to a new collection, not to the AOT output's.
    assert not a.guards.by_phase("inductor")
    assert reused.default.guards.by_phase("inductor")


def test_each_output_keeps_its_own_timings(reused: Reused) -> None:
    # Compiling the second configuration did not change what the first one reports.
    with torch.no_grad():
        again = Precompile.precompile(reused.default)
    for stage in ("dynamo", "aot_autograd", "inductor"):
        assert again.timings[stage] == reused.timings_before_other[stage]
        assert reused.artifact_default.timings[stage] == reused.timings_before_other[stage]
    # Both configurations come from one AOT output: they share its earlier timings.
    for stage in ("dynamo", "aot_autograd"):
        assert reused.artifact_other.timings[stage] == reused.artifact_default.timings[stage]
    assert reused.artifact_other.timings["inductor"] != reused.artifact_default.timings["inductor"]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_one_aot_output_compiles_again_after_its_first_compile(grad: bool) -> None:
    # A small model takes AOTAutograd's path that once failed on the second compile
    # ("traced_tangent_metas should be None before calling make_runtime_safe").
    model, (x,), _ = build_tiny_mlp()
    with torch.set_grad_enabled(grad):
        aot = Precompile.aot_autograd(Precompile.dynamo(model, x))
        code = aot.joint_graph.code
        artifacts = [
            Precompile.precompile(Precompile.inductor(aot)),
            Precompile.precompile(Precompile.inductor(aot, options=OTHER_CONFIG)),
        ]
    assert aot.training is grad
    assert aot.joint_graph.code == code
    for artifact in artifacts:
        model.zero_grad()
        with torch.set_grad_enabled(grad):
            out = artifact(x)
            expected = model(x)
        torch.testing.assert_close(out, expected)
        if grad:
            (got,) = torch.autograd.grad(out.sum(), model.fc1.weight)
            (want,) = torch.autograd.grad(expected.sum(), model.fc1.weight)
            torch.testing.assert_close(got, want)
