"""Stage outputs: frozen values that unpack like tuples and read as text.

One parametrised check of the shape every stage output shares, then what each
one's fields, text view and guards hold. All on the session's staged
transformer (one compile).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import platform
import types
import weakref

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
from torch_precompile.stages.handoff import handed_out

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


def _ours(meta: dict) -> list[str]:
    """The keys of a graph module's ``meta`` that hold one of this package's objects."""
    return [k for k, v in meta.items() if type(v).__module__.startswith("torch_precompile")]


def test_unpacked_pieces_find_their_stage_without_the_output_object(staged) -> None:
    """The seed's spelling: each stage finds the one before from the pieces alone, and
    nothing is written to a graph module's ``meta`` or to the guards."""
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(staged.model, staged.example)
        gc.collect()  # the DynamoOutput object itself is no longer referenced by the caller
        joint, guards = Precompile.aot_autograd(gm, guards)
        gc.collect()
        assert not _ours(gm.meta) and not _ours(joint.meta)
        assert not hasattr(guards, "handoff") and not hasattr(guards, "__dict__")
        compiled, guards = Precompile.inductor(joint, guards)
        gc.collect()
        art = Precompile.precompile(compiled)  # the compiled code alone leads on
        torch.testing.assert_close(art(staged.example), staged.expected)
    with pytest.raises(ValueError, match=r"does not come from Precompile\.dynamo"):
        Precompile.aot_autograd(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))


def _pieces_of_a_capture() -> tuple[torch.fx.GraphModule, weakref.ref, weakref.ref]:
    """A Dynamo graph module (its guards, output and AOT stage dropped), and weak
    references to the model it was captured from and to its stage's handoff."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(model, torch.randn(2, 4))
        joint, aot_guards = Precompile.aot_autograd(gm)  # the graph alone, its guards alive
    assert aot_guards.by_phase("aot_autograd") and joint is not gm
    return gm, weakref.ref(model), weakref.ref(handed_out(guards))


def test_handed_out_pieces_keep_nothing_alive() -> None:
    """A graph module leads back to its stage weakly: once the caller drops a stage's
    output and guards, its handoff (the capture, the model) is collected, and the
    graph module alone no longer leads back."""
    gm, model, handoff = _pieces_of_a_capture()
    gc.collect()
    assert handoff() is None and model() is None
    assert handed_out(gm) is None
    with pytest.raises(ValueError, match=r"does not come from Precompile\.dynamo"):
        Precompile.aot_autograd(gm)


def test_pieces_carry_their_way_back_no_table_does() -> None:
    """The guards a stage hands out carry its handoff and the graph module a weak lead
    to it; a collection derived from them carries nothing, and the module keeps no
    table of handed-out pieces."""
    from torch_precompile.stages import handoff as handoff_module

    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(model, torch.randn(2, 4))
    assert handed_out(guards) is not None and handed_out(guards) is handed_out(gm)
    assert handed_out(guards.extend(())) is None and handed_out(guards.by_phase("dynamo")) is None
    assert handed_out(copy.deepcopy(gm)) is None  # a pass's copy: passed with its guards
    tables = [
        name
        for name, value in vars(handoff_module).items()
        if isinstance(
            value, (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
        )
        and not name.startswith("__")
    ]
    assert not tables, tables
