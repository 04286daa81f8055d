"""Several compiled variants of one model in one artifact and one file.

``Precompile.precompile([...])`` bundles a static fast path for batch 1, a
dynamic fallback and a training variant; a call runs the first variant whose
guards hold, and a call no variant accepts raises a GuardError listing each
variant's first failing guard.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import no_compiler_env

from tests.fixtures.models import build_dropout_mlp
from torch_precompile import GuardError, Precompile, PrecompiledArtifact


def _staged(model: Any, x: torch.Tensor) -> Any:
    gm, _, guards = Precompile.dynamo(model, x)
    joint, guards = Precompile.aot_autograd(gm, guards)
    compiled, _ = Precompile.inductor(joint, guards)
    return compiled


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[PrecompiledArtifact, Any, Path]:
    model, _, _ = build_dropout_mlp()
    with torch.no_grad():
        fast = _staged(model, torch.randn(1, 32))
        x_dyn = torch.randn(4, 32)
        torch._dynamo.mark_dynamic(x_dyn, 0, min=2, max=64)
        dynamic = Precompile.precompile(_staged(model, x_dyn))  # an artifact is accepted too
    training = _staged(model, torch.randn(8, 32))  # grad enabled: a training variant
    with torch.no_grad():
        inference_fast = Precompile.precompile(fast)
    artifact = Precompile.precompile([inference_fast, dynamic, training])
    path = tmp_path_factory.mktemp("variants") / "mlp_variants.pt2"
    Precompile.save(path, artifact)
    return artifact, model, path


def _counting(fn: Any, index: int, ran: list[int]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        ran.append(index)
        return fn(*args, **kwargs)

    return call


def _which(artifact: PrecompiledArtifact, call: Any) -> tuple[int, Any]:
    """Run ``call`` and report which variant's compiled function ran."""
    ran: list[int] = []
    originals = []
    for i, variant in enumerate(artifact.variants):
        runtime = variant.runtime
        originals.append(runtime.call_step.fn)
        runtime.call_step.fn = _counting(runtime.call_step.fn, i, ran)
    try:
        out = call()
    finally:
        for variant, fn in zip(artifact.variants, originals):
            variant.runtime.call_step.fn = fn
    assert len(ran) == 1
    return ran[0], out


def test_bundle_describes_its_variants(bundle: tuple[PrecompiledArtifact, Any, Path]) -> None:
    artifact = bundle[0]
    assert len(artifact.variants) == 3
    assert "3 variants: inference, static; inference, dynamic; training, static" in repr(artifact)
    assert "variant 1 (inference, dynamic) guards:" in artifact.as_text()


@pytest.mark.parametrize(
    "batch,grad,expected", [(1, False, 0), (5, False, 1), (64, False, 1), (8, True, 2)]
)
def test_first_matching_variant_runs(
    bundle: tuple[PrecompiledArtifact, Any, Path], batch: int, grad: bool, expected: int
) -> None:
    artifact, model, _ = bundle
    x = torch.randn(batch, 32)
    with torch.set_grad_enabled(grad):
        index, out = _which(artifact, lambda: artifact(x))
        want = model(x)
    assert index == expected
    torch.testing.assert_close(out, want)
    if grad:
        assert out.grad_fn is not None
        out.sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        want.sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n], p.grad)
        model.zero_grad()


def test_no_variant_holds_lists_each_first_failure(
    bundle: tuple[PrecompiledArtifact, Any, Path],
) -> None:
    artifact = bundle[0]
    with torch.no_grad(), pytest.raises(GuardError) as info:
        artifact(torch.randn(100, 32))
    msg = str(info.value)
    assert "no variant's guards hold" in msg
    assert (
        "variant 0 (inference, static): input 'x': expected shape (1, 32), got (100, 32)" in msg
    ), msg
    assert "variant 1 (inference, dynamic): input 'x': dimension 0 must be in [2, 64]" in msg, msg
    assert "variant 2 (training, static): grad mode" in msg, msg


def test_fresh_process_bundle(
    bundle: tuple[PrecompiledArtifact, Any, Path], tmp_path: Path
) -> None:
    """One file, loaded elsewhere: same dispatch, same numbers, same error.

    The process has no C++ compiler: every variant (static, dynamic, training
    forward and backward) runs the kernels shipped in the file's one
    ``kernels`` section.
    """
    _, model, path = bundle
    xs = {b: torch.randn(b, 32, generator=torch.Generator().manual_seed(b)) for b in (1, 7, 8)}
    ref = tmp_path / "ref.pt"
    with torch.no_grad():
        torch.save({b: (x, model(x)) for b, x in xs.items()}, ref)
    script = tmp_path / "load_variants.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json
            import torch
            from torch_precompile import GuardError, Precompile

            art = Precompile.load({str(path)!r})
            loaded_as = [type(v.compiled_function).__name__ for v in art.variants]
            ref = torch.load({str(ref)!r})
            ran = []
            def counting(fn, index):
                def call(*args, **kwargs):
                    ran.append(index)
                    return fn(*args, **kwargs)
                return call
            for i, v in enumerate(art.variants):
                v.runtime.call_step.fn = counting(v.runtime.call_step.fn, i)
            with torch.no_grad():
                for b, (x, want) in ref.items():
                    torch.testing.assert_close(art(x), want)
            out = art(ref[8][0])  # grad enabled: the training variant
            out.sum().backward()
            grads = sum(p.grad.abs().sum().item() for p in art.parameters())
            try:
                with torch.no_grad():
                    art(torch.randn(100, 32))
                error = ""
            except GuardError as exc:
                error = str(exc)
            n = len(art.variants)
            print(json.dumps({{"ran": ran, "n": n, "grads": grads, "error": error,
                              "loaded_as": loaded_as}}))
            """
        )
    )
    env = no_compiler_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["n"] == 3
    # Every variant takes the lean load: inference (static, dynamic) and plain training.
    assert res["loaded_as"] == ["LeanCompiledFunction"] * 3
    assert res["ran"] == [0, 1, 1, 2]
    assert res["grads"] > 0
    assert (
        "variant 0" in res["error"] and "variant 1" in res["error"] and "variant 2" in res["error"]
    )
