"""Stage outputs: frozen values that unpack like tuples and read as text.

One parametrised check of the shape every stage output shares, then what each
one's fields, text view and guards hold. All on the session's staged
transformer (one compile).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import platform
import types

import pytest
import torch

from torch_precompile import (
    AOTAutogradOutput,
    DynamoOutput,
    Guards,
    InductorOutput,
    Precompile,
    PrecompiledArtifact,
)

# (stage attribute of the staged fixture, output type, types of the unpacked pieces)
STAGES = [
    ("dynamo", DynamoOutput, (torch.fx.GraphModule, types.CodeType, Guards)),
    ("aot", AOTAutogradOutput, (torch.fx.GraphModule, Guards)),
    ("inductor", InductorOutput, (object, Guards)),
]


@pytest.mark.parametrize(("stage", "kind", "pieces"), STAGES, ids=[s[0] for s in STAGES])
def test_stage_output_is_a_frozen_dataclass_that_unpacks(staged, stage, kind, pieces) -> None:
    out = getattr(staged, stage)
    assert isinstance(out, kind) and dataclasses.is_dataclass(out)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.guards = None  # type: ignore[misc]
    unpacked = tuple(out)
    assert len(unpacked) == len(pieces)
    assert all(isinstance(p, t) for p, t in zip(unpacked, pieces))
    assert unpacked[-1] is out.guards


def test_artifact_is_a_frozen_callable_dataclass(staged) -> None:
    art = staged.artifact
    assert isinstance(art, PrecompiledArtifact) and callable(art)
    with pytest.raises(dataclasses.FrozenInstanceError):
        art.training = True  # type: ignore[misc]
    with torch.no_grad():
        torch.testing.assert_close(art(staged.example), staged.expected)


def test_dynamo_text_shows_graph_code_and_input_sources(staged) -> None:
    text = staged.dynamo.as_text()
    assert "def forward" in text and "kind: inference" in text
    assert "L['ids']" in text and "L['self']._modules['blocks']._modules['0']" in text
    assert "parameter 'blocks.0." in text
    placeholders = [n for n in staged.dynamo.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(staged.dynamo.input_sources) == len(placeholders)
    assert staged.dynamo.training is False


def test_aot_text_is_the_aten_graph(staged) -> None:
    text = staged.aot.as_text()
    assert text.startswith("# AOTAutograd inference graph")
    assert "torch.ops.aten.embedding" in text


def test_inductor_text_is_the_generated_code(staged) -> None:
    text = staged.inductor.as_text()
    assert "# ===== Inductor forward =====" in text and "def call(" in text
    assert "backward" not in staged.inductor.source_code


def test_each_stage_keeps_the_guards_it_was_given_and_adds_its_own(staged) -> None:
    chain = [staged.dynamo.guards, staged.aot.guards, staged.inductor.guards]
    for before, after in itertools.pairwise(chain):
        assert list(after)[: len(before)] == list(before)
    added = staged.aot.guards.by_phase("aot_autograd")
    assert any(g.kind == "autograd" and g.training is False for g in added)
    system = {g.key for g in staged.inductor.guards.by_phase("inductor") if g.kind == "system"}
    assert {"device_type", "torch", "cpu_isa"} <= system


def test_artifact_records_signature_system_timings_and_weights(staged) -> None:
    art = staged.artifact
    assert art.signature.parameters["ids"]["tensor"] == {
        "dtype": "int64",
        "shape": [2, 32],
        "device": "cpu",
        "requires_grad": False,
        "contiguous": True,
    }
    assert art.system["torch"] == torch.__version__
    assert art.system["python"] == platform.python_version()
    assert {"dynamo", "aot_autograd", "inductor", "precompile"} <= set(art.timings)
    assert all(t > 0 for t in art.timings.values())
    text = art.as_text()
    assert all(h in text for h in ("dynamo (", "aot_autograd (", "inductor (", "stage timings:"))
    assert set(dict(art.named_parameters())) == set(dict(staged.model.named_parameters()))
    assert len(list(art.buffers())) == len(list(staged.model.buffers()))


def test_unpacked_pieces_find_their_stage_without_the_output_object(staged) -> None:
    """No process-wide registry: the pieces carry their stage output themselves."""
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(staged.model, staged.example)
        gc.collect()  # the DynamoOutput object itself is no longer referenced by the caller
        joint, guards = Precompile.aot_autograd(gm, guards)
        gc.collect()
        assert guards.handoff.stage == "aot_autograd"
        assert joint.meta["torch_precompile_handoff"] is guards.handoff
        compiled, guards = Precompile.inductor(joint, guards)
        gc.collect()
        assert compiled.handoff is guards.handoff  # the compiled code alone leads on
        art = Precompile.precompile(compiled)
        torch.testing.assert_close(art(staged.example), staged.expected)
    with pytest.raises(ValueError, match=r"does not come from Precompile\.dynamo"):
        Precompile.aot_autograd(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
