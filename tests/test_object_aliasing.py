"""Two attributes that hold one object (a config shared by a model and its submodule).

Dynamo guards that they stay one object: torch 2.13 with an ``is`` check of
its own, 2.14 with an ``OBJECT_ALIASING`` guard. The lean guards of a lean
load translate both, so a model whose attributes no longer share the object is
refused by the lean check as by Dynamo's, with a ``GuardError``, without
falling back from the lean path.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from torch_precompile import GuardError, Precompile


class Settings:
    def __init__(self) -> None:
        self.scale = 2.0
        self.shift = 1.0


class Inner(torch.nn.Module):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.settings.scale


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.settings = Settings()
        self.inner = Inner(self.settings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.settings.shift


def test_shared_object_guard_is_checked_lean_as_dynamo_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Outer().eval(), torch.randn(2, 4)
    with torch.no_grad():
        art = Precompile.compile(model, (x,))
    path = tmp_path / "shared.pt"
    Precompile.save(path, art)
    loaded = Precompile.load(path, model=model)
    guards = loaded.runtime.guard_manager
    assert type(loaded.compiled_function).__name__ == "LeanCompiledFunction"
    assert guards.lean_guards is not None
    # torch 2.14's form of the guard, translated (not a refusal of the lean path).
    assert bool(guards.lean_guards._same_groups) == (torch.__version__ >= "2.14")
    f_locals = {"self": model, "x": x}
    with torch.no_grad():  # as captured (grad mode is guarded)
        assert guards.lean_guards.check(f_locals) and guards.full.check(f_locals)
        torch.testing.assert_close(loaded(x), model(x))

        model.inner.settings = copy.copy(model.settings)  # equal values, not one object
        assert not guards.lean_guards.check(f_locals) and not guards.full.check(f_locals)
        with pytest.raises(GuardError):
            loaded(x)
        model.inner.settings = model.settings  # one object again: accepted
        assert guards.lean_guards.check(f_locals)
        torch.testing.assert_close(loaded(x), model(x))
