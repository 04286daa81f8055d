"""Precompile.precompile: a callable artifact that checks its guards."""

from __future__ import annotations

import pytest
import torch

from torch_precompile import GuardError, Precompile


def test_artifact_matches_eager(staged) -> None:
    with torch.no_grad():
        torch.testing.assert_close(staged.artifact(staged.example), staged.expected)


def test_accepts_the_unpacked_compiled_object(staged) -> None:
    compiled, _ = staged.inductor
    art = Precompile.precompile(compiled)
    with torch.no_grad():
        torch.testing.assert_close(art(staged.example), staged.expected)


def test_rejects_something_else() -> None:
    with pytest.raises(TypeError, match=r"takes the output of Precompile\.inductor"):
        Precompile.precompile(torch.nn.Linear(2, 2))


def test_inference_artifact_with_grad_enabled_says_what_to_do(staged) -> None:
    # The model's parameters require grad, so eager would build a graph: refuse.
    with pytest.raises(GuardError) as info:
        staged.artifact(staged.example)
    message = str(info.value)
    assert "inference artifact" in message and "torch.no_grad()" in message
    assert message.endswith("[aot_autograd]")


def test_changed_python_attribute_is_a_guard_error(staged) -> None:
    block = staged.model.blocks[0].attn
    old = block.n_heads
    block.n_heads = old * 2
    try:
        with (
            torch.no_grad(),
            pytest.raises(
                GuardError, match=r"attribute 'blocks.0.attn.n_heads': expected 4, got 8"
            ),
        ):
            staged.artifact(staged.example)
    finally:
        block.n_heads = old
    with torch.no_grad():
        torch.testing.assert_close(staged.artifact(staged.example), staged.expected)


def test_changed_parameter_shape_is_a_guard_error(staged) -> None:
    head = staged.model.head
    old = head.bias
    head.bias = torch.nn.Parameter(torch.zeros(7))
    try:
        with (
            torch.no_grad(),
            pytest.raises(
                GuardError, match=r"parameter 'head.bias': expected shape \(1000,\), got \(7,\)"
            ),
        ):
            staged.artifact(staged.example)
    finally:
        head.bias = old


def test_default_dtype_change_is_a_guard_error(staged) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        with (
            torch.no_grad(),
            pytest.raises(GuardError, match="default dtype: expected float32, got float64"),
        ):
            staged.artifact(staged.example)
    finally:
        torch.set_default_dtype(torch.float32)


def test_in_process_artifact_uses_the_live_weights(staged) -> None:
    bias = staged.model.head.bias
    before = bias.detach().clone()
    with torch.no_grad():
        bias.add_(1.0)
        try:
            torch.testing.assert_close(
                staged.artifact(staged.example), staged.model(staged.example)
            )
        finally:
            bias.copy_(before)  # exactly: (b + 1) - 1 is not b in fp32


def test_thread_count_change_is_a_readable_guard_error(staged) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with torch.no_grad(), pytest.raises(GuardError) as info:
            staged.artifact(staged.example)
    finally:
        torch.set_num_threads(threads)
    message = str(info.value)
    assert message.startswith(f"num threads: expected {threads}, got {threads + 1}")
    assert "torch.set_num_threads()" in message and message.endswith("[dynamo]")
