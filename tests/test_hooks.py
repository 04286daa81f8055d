"""Module hooks are refused with a GuardError naming the module and the hook, never ignored.

In process, after a lean load and after a load through PyTorch's full path,
bound to the live model (``load(model=m)``) or to the stand-in: a forward
hook, forward pre-hook or backward hook on a submodule or on the model, and
a global module hook, each raise ``GuardError``; once removed, the artifact
gives eager's answer again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_script

from torch_precompile import GuardError, Precompile


@pytest.fixture(scope="module")
def built(staged: Any) -> tuple[Any, torch.Tensor, Any, Path]:
    """The session's reference transformer artifact (conftest), compiled once for all."""
    return staged.model, staged.example, staged.artifact, staged.path


def _double(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _pre(module: Any, args: Any) -> Any:
    return (args[0] * 0.5,)


def _backward(module: Any, grad_in: Any, grad_out: Any) -> None:
    return None


HOOKS = {
    "forward hook": lambda m: m.register_forward_hook(_double),
    "forward pre-hook": lambda m: m.register_forward_pre_hook(_pre),
    "backward hook": lambda m: m.register_full_backward_hook(_backward),
    "backward pre-hook": lambda m: m.register_full_backward_pre_hook(lambda m, g: None),
}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_submodule_hook_refused_in_process(built: Any, kind: str) -> None:
    model, ids, art, _ = built
    handle = HOOKS[kind](model.blocks[0].attn)
    try:
        with torch.no_grad(), pytest.raises(GuardError) as info:
            art(ids)
    finally:
        handle.remove()
    message = str(info.value)
    assert "module 'blocks.0.attn' has a " + kind in message
    assert "handle.remove()" in message
    with torch.no_grad():
        torch.testing.assert_close(art(ids), model(ids))


def test_hook_changes_eager_result(built: Any) -> None:
    """The hooks used here do change eager's output: ignoring them would be wrong."""
    model, ids, _, _ = built
    with torch.no_grad():
        plain = model(ids)
        handle = model.blocks[1].mlp.fc1.register_forward_pre_hook(_pre)
        hooked = model(ids)
        handle.remove()
    assert (plain - hooked).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook", "backward hook"])
def test_root_hook_refused_in_process(built: Any, kind: str) -> None:
    model, ids, art, _ = built
    handle = HOOKS[kind](model)
    try:
        with torch.no_grad(), pytest.raises(GuardError, match=f"the model has a {kind}"):
            art(ids)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "register",
    [
        torch.nn.modules.module.register_module_forward_hook,
        torch.nn.modules.module.register_module_forward_pre_hook,
    ],
)
def test_global_hook_refused_in_process(built: Any, register: Any) -> None:
    model, ids, art, _ = built
    hook = _double if register is torch.nn.modules.module.register_module_forward_hook else _pre
    handle = register(hook)
    try:
        with torch.no_grad(), pytest.raises(GuardError, match="global forward") as info:
            art(ids)
    finally:
        handle.remove()
    assert register.__name__ in str(info.value)
    assert "_double" in str(info.value) or "_pre" in str(info.value)
    with torch.no_grad():
        torch.testing.assert_close(art(ids), model(ids))


def test_guard_listing_says_what_is_checked(built: Any) -> None:
    _, _, art, path = built
    text = str(art.guards)
    assert "no module hooks: the model and the 28 submodules the compiled code calls" in text
    assert "EMPTY_NN_MODULE_HOOKS_DICT" not in text  # no longer counted as a check Dynamo skips
    assert "no module hooks" in art.as_text()
    loaded = Precompile.load(path)
    assert [g for g in loaded.guards if g.kind == "hooks"] == [
        g for g in art.guards if g.kind == "hooks"
    ]


_FRESH = """
import os, sys, torch
from tests.fixtures.models import build_transformer
from torch_precompile import GuardError, Precompile

model, (ids,), _ = build_transformer()
bind = sys.argv[2] == "model"
art = Precompile.load(sys.argv[1], model=model if bind else None)
fast = type(art.compiled_function).__name__ == "LeanCompiledFunction"
assert fast == (os.environ.get("TORCH_PRECOMPILE_LEAN") != "0"), fast
m = model if bind else art.module
with torch.no_grad():
    expected = model(ids)
    torch.testing.assert_close(art(ids), expected)
    cases = [
        (m.get_submodule("blocks.1.attn.v_proj"), "module 'blocks.1.attn.v_proj' has a "),
        (m.get_submodule("tok_emb"), "module 'tok_emb' has a forward hook"),
        (m, "the model has a forward hook"),
    ]
    for target, words in cases:
        handle = target.register_forward_hook(lambda mod, a, o: o * 2)
        try:
            art(ids)
            raise SystemExit("hook ignored: " + words)
        except GuardError as e:
            assert words in str(e), str(e)
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)
    try:
        art(ids)
        raise SystemExit("global hook ignored")
    except GuardError as e:
        assert "global forward hook" in str(e), str(e)
    handle.remove()
    torch.testing.assert_close(art(ids), expected)
print("ok")
"""


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "full"])
@pytest.mark.parametrize("bind", ["model", "standin"])
def test_hooks_refused_after_load(
    built: Any, fast: bool, bind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, _, path = built
    monkeypatch.setenv("TORCH_PRECOMPILE_LEAN", "1" if fast else "0")
    assert run_script(_FRESH, str(path), bind).stdout.strip().endswith("ok")
