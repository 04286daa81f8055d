"""DynamoOutput: frozen, iterable, readable (seed TODO 2.1)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from torch_precompile import DynamoOutput, Guards


def test_is_a_frozen_dataclass(staged) -> None:
    out = staged.dynamo
    assert isinstance(out, DynamoOutput)
    assert dataclasses.is_dataclass(out)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.graph_module = None  # type: ignore[misc]


def test_unpacks_to_graph_bytecode_guards(staged) -> None:
    gm, bytecode, guards = staged.dynamo
    assert isinstance(gm, torch.fx.GraphModule)
    assert isinstance(bytecode, types.CodeType)
    assert isinstance(guards, Guards)
    assert gm is staged.dynamo.graph_module and guards is staged.dynamo.guards


def test_as_text_shows_graph_code_and_input_sources(staged) -> None:
    text = staged.dynamo.as_text()
    assert "def forward" in text
    assert "L['ids']" in text
    assert "L['self']._modules['blocks']._modules['0']" in text
    assert "parameter 'blocks.0." in text
    assert "kind: inference" in text


def test_input_sources_cover_every_placeholder(staged) -> None:
    placeholders = [n for n in staged.dynamo.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(staged.dynamo.input_sources) == len(placeholders)
    assert "L['ids']" in staged.dynamo.input_sources
    assert staged.dynamo.training is False
