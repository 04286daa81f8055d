"""``import torch_precompile`` registers torch.Precompile / torch.precompile."""

from __future__ import annotations

import torch
from conftest import run_script

import torch_precompile


def test_torch_namespace_is_registered() -> None:
    assert torch.Precompile is torch_precompile.Precompile
    assert torch.precompile is torch_precompile
    for name in ("dynamo", "aot_autograd", "inductor", "precompile", "save", "load"):
        assert callable(getattr(torch.Precompile, name))


def test_seed_spelling_works_end_to_end_in_a_fresh_process() -> None:
    proc = run_script(
        """
        import torch, torch_precompile
        def f(x, y):
            return torch.relu(x) * y.sum()
        x, y = torch.randn(4, 5), torch.randn(3)
        gm, bytecode, guards = torch.Precompile.dynamo(f, (x, y))
        joint, guards = torch.Precompile.aot_autograd(gm, guards)
        compiled, guards = torch.Precompile.inductor(joint, guards)
        art = torch.Precompile.precompile(compiled)
        torch.testing.assert_close(art(x, y), f(x, y))
        print("ok", type(art).__name__)
        """
    )
    assert "ok PrecompiledArtifact" in proc.stdout
