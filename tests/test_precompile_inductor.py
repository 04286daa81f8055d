"""Precompile.inductor: compiled code, options, joint-graph passes."""

from __future__ import annotations

import copy

import pytest
import torch

from torch_precompile import Precompile


def test_compiled_function_matches_eager_on_flat_inputs(staged) -> None:
    compiled = staged.inductor.compiled
    f_locals = {"self": staged.model, "ids": staged.example}
    flat = [eval(s, {}, {"L": f_locals}) for s in staged.dynamo.input_sources]
    with torch.no_grad():
        out = compiled(*flat)
    torch.testing.assert_close(out[0], staged.expected)


def test_a_pass_on_the_aten_graph_shows_in_the_artifact() -> None:
    joint, guards, x = _exp_graph()
    with torch.no_grad():
        for node in joint.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.exp.default:
                node.target = torch.ops.aten.cos.default
        joint.recompile()
        compiled, guards = Precompile.inductor(joint, guards)
        art = Precompile.precompile(compiled)
        torch.testing.assert_close(art(x), torch.cos(x) + 1)


def _exp_graph() -> tuple[torch.fx.GraphModule, object, torch.Tensor]:
    def f(x):
        return torch.exp(x) + 1

    x = torch.randn(16)
    with torch.no_grad():
        gm, _, guards = Precompile.dynamo(f, x)
        joint, guards = Precompile.aot_autograd(gm, guards)
    return joint, guards, x


def test_a_pass_returning_a_new_graph_module_shows_in_the_artifact() -> None:
    """A pass may return a new graph module (not the one it was given): found by its guards."""
    joint, guards, x = _exp_graph()
    new = torch.fx.GraphModule(joint, copy.deepcopy(joint.graph))
    for node in new.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.exp.default:
            node.target = torch.ops.aten.sin.default
    new.recompile()
    with torch.no_grad():
        art = Precompile.precompile(Precompile.inductor(new, guards))
        torch.testing.assert_close(art(x), torch.sin(x) + 1)


def test_a_new_graph_module_with_another_input_count_is_a_value_error() -> None:
    """A new graph module from a pass that adds a placeholder: the documented ValueError."""
    joint, guards, _ = _exp_graph()
    graph = copy.deepcopy(joint.graph)
    first = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_before(first):
        graph.placeholder("extra")
    new = torch.fx.GraphModule(joint, graph)
    with pytest.raises(ValueError, match="takes 2 inputs, but the capture passes 1"):
        Precompile.inductor(new, guards)


def test_options_reach_inductor() -> None:
    def f(x):
        return torch.tanh(x) * 3

    x = torch.randn(8)
    with torch.no_grad():
        out = Precompile.inductor(
            Precompile.aot_autograd(Precompile.dynamo(f, x)),
            options={"cpp.simdlen": 0},
        )
    # simdlen 0 disables vectorisation: no Vectorized<float> in the kernel.
    assert "Vectorized" not in out.as_text()
    torch.testing.assert_close(Precompile.precompile(out)(x), f(x))


def test_unknown_mode_is_rejected() -> None:
    x = torch.randn(8)
    with torch.no_grad():
        aot = Precompile.aot_autograd(Precompile.dynamo(torch.sin, x))
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        Precompile.inductor(aot, mode="warp-speed")
