"""Token ids out of range raise IndexError, as eager does; the process serves the next call.

Inductor's C++ kernels check indirect indices inside an OpenMP parallel
region, where a failed check aborts the process. The artifact checks each
index input against the range recorded from the compiled graph before the
kernels run. Calls after load run in fresh processes (a regression would
abort them, not the test run); the in-process calls first assert that the
check is there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_script

from torch_precompile import Precompile

BAD = [1000, -1, 10**9, -(10**9)]


def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    return model, torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def transformer(staged: Any) -> tuple[Any, torch.Tensor, Any, Path]:
    """The session's reference transformer artifact (conftest), compiled once for all."""
    return staged.model, staged.example, staged.artifact, staged.path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, torch.Tensor, Any, Path]:
    pytest.importorskip("transformers")
    model, ids = _gpt2()
    with torch.no_grad():
        art = Precompile.compile(model, ids)
    path = tmp_path_factory.mktemp("bounds") / "gpt2.pt"
    Precompile.save(path, art)
    return model, ids, art, path


def _index_guards(art: Any) -> list[Any]:
    return [g for g in art.guards if g.kind == "index"]


def test_index_guard_recorded(transformer: Any) -> None:
    _, _, art, _ = transformer
    (g,) = _index_guards(art)
    assert g.phase == "inductor" and g.subject == "L['ids']"
    assert g.min == 0 and g.max == 1000
    assert "input 'ids': values in [0, 1000) (embedding into dimension 0 of parameter " in str(
        art.guards
    )


@pytest.mark.parametrize("bad", BAD)
def test_out_of_range_raises_in_process(transformer: Any, bad: int) -> None:
    model, ids, art, _ = transformer
    assert _index_guards(art), "without the check this call would abort the test run"
    ids_bad = ids.clone()
    ids_bad[1, 7] = bad
    with torch.no_grad():
        with pytest.raises(IndexError):
            model(ids_bad)  # eager's behaviour
        with pytest.raises(IndexError, match=r"input 'ids': index out of range.*\[0, 1000\)"):
            art(ids_bad)
        torch.testing.assert_close(art(ids), model(ids))


def test_range_edges_accepted(transformer: Any) -> None:
    model, ids, art, _ = transformer
    edge = ids.clone()
    edge[0, 0], edge[1, -1] = 0, 999
    with torch.no_grad():
        torch.testing.assert_close(art(edge), model(edge))


_FRESH_TRANSFORMER = """
import os, sys, torch
from tests.fixtures.models import build_transformer
from torch_precompile import Precompile

model, (ids,), _ = build_transformer()
art = Precompile.load(sys.argv[1], model=model if sys.argv[2] == "model" else None)
fast = type(art.compiled_function).__name__ == "LeanCompiledFunction"
assert fast == (os.environ["TORCH_PRECOMPILE_LEAN"] == "1"), fast
with torch.no_grad():
    for bad in (1000, -1, 10**9, -10**9):
        ids_bad = ids.clone()
        ids_bad[0, 5] = bad
        try:
            art(ids_bad)
            raise SystemExit(f"no error for {bad}")
        except IndexError as e:
            assert "input 'ids'" in str(e) and "[0, 1000)" in str(e), str(e)
    torch.testing.assert_close(art(ids), model(ids))
print("ok")
"""


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fast", "full"])
@pytest.mark.parametrize("bind", ["model", "standin"])
def test_out_of_range_after_load(
    transformer: Any, fast: str, bind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_PRECOMPILE_LEAN", fast)
    proc = run_script(_FRESH_TRANSFORMER, str(transformer[3]), bind)
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.parametrize("bad", [1000, -1])
def test_gpt2_out_of_range_in_process(gpt2: Any, bad: int) -> None:
    model, ids, art, _ = gpt2
    (g,) = _index_guards(art)
    assert "parameter 'transformer.wte.weight'" in g.expr
    ids_bad = ids.clone()
    ids_bad[0, 3] = bad
    with torch.no_grad():
        with pytest.raises(IndexError):
            model(ids_bad)
        with pytest.raises(IndexError, match=r"index out of range.*\[0, 1000\)"):
            art(ids_bad)
        torch.testing.assert_close(art(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


_FRESH_GPT2 = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_index_bounds import _gpt2
from torch_precompile import Precompile

model, ids = _gpt2()
art = Precompile.load(sys.argv[1])
with torch.no_grad():
    for bad in (1000, -1, 10**9):
        ids_bad = ids.clone()
        ids_bad[1, 0] = bad
        try:
            art(ids_bad)
            raise SystemExit(f"no error for {bad}")
        except IndexError as e:
            assert "[0, 1000)" in str(e), str(e)
    torch.testing.assert_close(art(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
print("ok")
"""


# HF GPT-2 loads through PyTorch's full path either way (its graph returns aliases of
# inputs); both settings are run so that a future lean load of it is covered.
@pytest.mark.parametrize("fast", ["1", "0"], ids=["FAST_LOAD=1", "FAST_LOAD=0"])
def test_gpt2_out_of_range_after_load(
    gpt2: Any, fast: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_PRECOMPILE_LEAN", fast)
    tests_dir = str(Path(__file__).resolve().parent)
    proc = run_script(_FRESH_GPT2, str(gpt2[3]), tests_dir)
    assert proc.stdout.strip().endswith("ok")


_UNCHECKED = """
import sys, torch
from tests.fixtures.models import build_transformer
from torch_precompile import Precompile

model, (ids,), _ = build_transformer()
art = Precompile.load(sys.argv[1], model=model)
# Without the index checks, as every artifact ran before them:
next(s for s in art.runtime.checks if hasattr(s, "indices")).indices.checks.clear()
ids[0, 5] = 10**9
with torch.no_grad():
    art(ids)
"""


def test_kernel_alone_aborts(transformer: Any) -> None:
    """Why the check exists: Inductor's kernel aborts the process on this input."""
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_UNCHECKED), str(transformer[3])],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "index out of bounds" in proc.stderr
