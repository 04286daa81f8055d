"""Precompile.aot_autograd: ATen graphs, joint for training, user passes."""

from __future__ import annotations

import pytest
import torch

from torch_precompile import Precompile


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)))


def test_inference_graph_has_no_backward(staged) -> None:
    assert staged.aot.training is False
    outputs = [n for n in staged.aot.joint_graph.graph.nodes if n.op == "output"]
    assert len(outputs) == 1


def test_grad_enabled_capture_gives_a_joint_graph() -> None:
    torch.manual_seed(0)
    model = _Small()
    out = Precompile.aot_autograd(Precompile.dynamo(model, torch.randn(4, 8)))
    assert out.training is True
    text = out.as_text()
    assert "joint forward+backward" in text
    # The joint graph takes tangents and computes gradients (e.g. of the matmul).
    assert "tangents" in text
    assert any(g.kind == "autograd" and g.training is True for g in out.guards)


def test_unpacked_graph_and_guards_are_accepted() -> None:
    model = _Small().eval()
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(model, torch.randn(4, 8))
        joint, guards2 = Precompile.aot_autograd(gm, guards)
    assert isinstance(joint, torch.fx.GraphModule)
    assert len(guards2) > len(guards)


def test_a_pass_on_the_dynamo_graph_shows_in_the_result() -> None:
    torch.manual_seed(0)
    model = _Small().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(model, x)
        # Replace relu by sigmoid: the compiled artifact must compute the rewritten graph.
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (torch.relu, torch.nn.functional.relu):
                node.target = torch.sigmoid
                node.kwargs = {}
        gm.recompile()
        joint, guards = Precompile.aot_autograd(gm, guards)
        assert "sigmoid" in joint.code and "relu" not in joint.code
        art = Precompile.precompile(Precompile.inductor(joint, guards))
        expected = model.norm(torch.sigmoid(model.fc(x)))
        torch.testing.assert_close(art(x), expected)


def test_a_pass_that_adds_an_input_is_rejected_with_a_clear_error() -> None:
    model = _Small().eval()
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(model, torch.randn(4, 8))
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_before(first):
        gm.graph.placeholder("extra")
    gm.recompile()
    with pytest.raises(ValueError, match="takes 6 inputs, but the capture passes 5"):
        Precompile.aot_autograd(gm, guards)


def test_a_graph_from_elsewhere_is_rejected() -> None:
    gm = torch.fx.symbolic_trace(_Small())
    with pytest.raises(ValueError, match=r"does not come from Precompile\.dynamo"):
        Precompile.aot_autograd(gm)
