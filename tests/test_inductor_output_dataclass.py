"""InductorOutput: frozen, iterable, readable (seed TODO 4.1)."""

from __future__ import annotations

import dataclasses

import pytest

from torch_precompile import Guards, InductorOutput


def test_is_a_frozen_dataclass(staged) -> None:
    out = staged.inductor
    assert isinstance(out, InductorOutput)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.compiled = None  # type: ignore[misc]


def test_unpacks_to_compiled_and_guards(staged) -> None:
    compiled, guards = staged.inductor
    assert callable(compiled)
    assert isinstance(guards, Guards)


def test_as_text_shows_generated_code(staged) -> None:
    text = staged.inductor.as_text()
    assert "===== Inductor forward =====" in text
    # CPU kernels are C++ emitted by Inductor's cpp backend.
    assert 'extern "C"' in text or "cpp_fused" in text
    assert "backward" not in staged.inductor.source_code


def test_guards_accumulate_and_add_system_assumptions(staged) -> None:
    before, after = staged.aot.guards, staged.inductor.guards
    assert list(after)[: len(before)] == list(before)
    added = after.by_phase("inductor")
    subjects = {g.subject for g in added}
    assert {"device_type", "torch", "cpu_isa"} <= subjects
    assert any("torch version ==" in g.expr for g in added)
