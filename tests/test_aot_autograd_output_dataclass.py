"""AOTAutogradOutput: frozen, iterable, readable (seed TODO 3.1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_precompile import AOTAutogradOutput, Guards


def test_is_a_frozen_dataclass(staged) -> None:
    out = staged.aot
    assert isinstance(out, AOTAutogradOutput)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.guards = None  # type: ignore[misc]


def test_unpacks_to_joint_graph_and_guards(staged) -> None:
    joint, guards = staged.aot
    assert isinstance(joint, torch.fx.GraphModule)
    assert isinstance(guards, Guards)


def test_as_text_is_the_aten_graph(staged) -> None:
    text = staged.aot.as_text()
    assert text.startswith("# AOTAutograd inference graph")
    assert "torch.ops.aten." in text
    assert "torch.ops.aten.embedding" in text


def test_guards_keep_dynamo_entries_and_add_grad_mode(staged) -> None:
    before, after = staged.dynamo.guards, staged.aot.guards
    assert list(after)[: len(before)] == list(before)
    added = after.by_phase("aot_autograd")
    assert len(added) >= 1
    assert any(g.kind == "autograd" and "inference artifact" in g.expr for g in added)
