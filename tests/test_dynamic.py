"""Dynamic shapes: one artifact serves many batch sizes and sequence lengths.

The GPT decoder is captured once with ``torch._dynamo.mark_dynamic(ids, 0,
min=1, max=8)`` and ``mark_dynamic(ids, 1, min=1, max=128)``; a fresh process
with no C++ compiler and an empty Inductor cache loads it (the kernels shipped
in the file) and serves every batch 1..8 x sequence 1..128 with no
compilation. Without the shipped kernels the same process fails to load.
Sizes outside the recorded ranges raise a GuardError stating the range.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import no_compiler_env

from tests.fixtures.models import build_dropout_mlp, build_gpt
from torch_precompile import GuardError, Precompile
from torch_precompile import file as container

# Every batch 1..8 with these lengths (the boundaries, powers of two and their
# neighbours); set TORCH_PRECOMPILE_FULL_GRID=1 to serve all 128 lengths.
SEQS = (
    list(range(1, 129))
    if os.environ.get("TORCH_PRECOMPILE_FULL_GRID")
    else [1, 2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 65, 100, 127, 128]
)


@pytest.fixture(scope="module")
def gpt_dynamic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    model, (ids,), _ = build_gpt()
    ids = ids.clone()
    torch._dynamo.mark_dynamic(ids, 0, min=1, max=8)
    torch._dynamo.mark_dynamic(ids, 1, min=1, max=128)
    with torch.no_grad():
        gm, bytecode, guards = Precompile.dynamo(model, ids)
        joint, guards = Precompile.aot_autograd(gm, guards)
        compiled, guards = Precompile.inductor(joint, guards)
        artifact = Precompile.precompile(compiled)
    path = tmp_path_factory.mktemp("dyn") / "gpt_dynamic.pt2"
    Precompile.save(path, artifact, bytecode, guards)
    return artifact, model, path


@pytest.fixture(scope="module")
def mlp_dynamic_true() -> tuple[Any, Any]:
    """``dynamic=True`` without the size-1 variants: Dynamo specialises 0/1."""
    model, (x,), _ = build_dropout_mlp()
    with torch.no_grad():
        artifact = Precompile.compile(model, x, dynamic=True, size_one=False)
    return artifact, model


def test_dynamic_true_serves_batch_one_with_a_variant(tmp_path: Path) -> None:
    """By default a dynamic compile bundles a variant at size 1 where Dynamo left 1 out."""
    model, (x,), _ = build_dropout_mlp()
    with torch.no_grad():
        artifact = Precompile.compile(model, x, dynamic=True)
    assert len(artifact.variants) == 2
    path = tmp_path / "mlp_dynamic_one.pt2"
    Precompile.save(path, artifact)
    for served in (artifact, Precompile.load(path)):
        for batch in (1, 2, 7):
            x = torch.randn(batch, 32)
            with torch.no_grad():
                torch.testing.assert_close(served(x), model(x))
    # A row sliced out of a wider batch: contiguous, but its size-1 dimension has the
    # wider stride (eager does not care; the guards compare every dimension's stride).
    row = torch.randn(7, 64)[:1, :32]
    assert row.is_contiguous() and row.stride() == (64, 1)
    for served in (artifact, Precompile.load(path)):
        with torch.no_grad():
            torch.testing.assert_close(served(row), model(row))


@pytest.fixture(scope="module")
def mlp_size_oblivious() -> tuple[Any, Any]:
    """``dynamic=True, size_oblivious=True``: 1 stays inside the batch range."""
    model, (x,), _ = build_dropout_mlp()
    with torch.no_grad():
        artifact = Precompile.compile(model, x, dynamic=True, size_oblivious=True)
    return artifact, model


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(
        0, 512, (batch, seq), generator=torch.Generator().manual_seed(batch * 1000 + seq)
    )


def test_ranges_are_recorded_as_shape_guards(gpt_dynamic: tuple[Any, Any, Path]) -> None:
    artifact = gpt_dynamic[0]
    ranges = [g for g in artifact.guards if g.kind == "range"]
    got = {(g.dim, g.min, g.max) for g in ranges}
    assert got == {(0, 1, 8), (1, 1, 128)}, [g.expr for g in ranges]
    assert all(g.subject == "L['ids']" for g in ranges)
    assert "input 'ids': dimension 0" in str(artifact.guards)


@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 128), (8, 1), (8, 128), (3, 17), (2, 16)])
def test_in_process_sizes_match_eager(
    gpt_dynamic: tuple[Any, Any, Path], batch: int, seq: int
) -> None:
    artifact, model, _ = gpt_dynamic
    ids = _ids(batch, seq)
    with torch.no_grad():
        torch.testing.assert_close(artifact(ids), model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape,dim,allowed",
    [((9, 16), 0, "[1, 8]"), ((2, 129), 1, "[1, 128]"), ((0, 16), 0, "[1, 8]")],
)
def test_out_of_range_states_the_range(
    gpt_dynamic: tuple[Any, Any, Path], shape: tuple[int, int], dim: int, allowed: str
) -> None:
    artifact = gpt_dynamic[0]
    with torch.no_grad(), pytest.raises(GuardError) as info:
        artifact(torch.zeros(shape, dtype=torch.long))
    msg = str(info.value)
    assert f"input 'ids': dimension {dim} must be in {allowed}" in msg, msg
    assert f"got {shape[dim]}" in msg


def test_dynamic_true_specialises_zero_one(mlp_dynamic_true: tuple[Any, Any]) -> None:
    artifact, model = mlp_dynamic_true
    for batch in (2, 5, 64):
        x = torch.randn(batch, 32)
        with torch.no_grad():
            torch.testing.assert_close(artifact(x), model(x))
    with torch.no_grad(), pytest.raises(GuardError) as info:
        artifact(torch.randn(1, 32))
    msg = str(info.value)
    assert "dimension 0 must be in [2, inf]" in msg and "got 1" in msg, msg
    assert "0/1 are specialised" in msg and "size_oblivious=True" in msg, msg
    assert "size_one=True" in msg and "mark_dynamic(t, dim, min=1)" in msg, msg


def test_mark_dynamic_with_a_lower_bound_only_is_served() -> None:
    """``mark_dynamic(x, 0, min=1)`` with no ``max``, as the size-1 hint suggests:
    Dynamo's own capture crashes on it (``not simple sympy type``); ours serves
    1 and above, and leaves the caller's marks as they were."""
    model, (x,), _ = build_dropout_mlp()
    x = x.clone()
    torch._dynamo.mark_dynamic(x, 0, min=1)
    marks = set(x._dynamo_dynamic_range)
    with torch.no_grad():
        artifact = Precompile.compile(model, x, size_one=False)
        assert x._dynamo_dynamic_range == marks
        for batch in (1, 3, 200):
            y = torch.randn(batch, 32)
            torch.testing.assert_close(artifact(y), model(y))


def test_dynamic_true_loads_on_the_fast_path(
    mlp_dynamic_true: tuple[Any, Any], tmp_path: Path
) -> None:
    """A ``dynamic=True`` artifact runs from its shipped kernels after load, any batch >= 2."""
    artifact, model = mlp_dynamic_true
    path = tmp_path / "mlp_dynamic_true.pt2"
    Precompile.save(path, artifact)
    loaded = Precompile.load(path)
    assert type(loaded.compiled_function).__name__ == "LeanCompiledFunction"
    for batch in (2, 3, 100):
        x = torch.randn(batch, 32)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), model(x))
    with torch.no_grad(), pytest.raises(GuardError, match=r"dimension 0 must be in \[2, inf\]"):
        loaded(torch.randn(1, 32))


@pytest.mark.parametrize("load_path", ["fast", "full"])
def test_fresh_process_serves_all_sizes_without_compiling(
    gpt_dynamic: tuple[Any, Any, Path], tmp_path: Path, load_path: str
) -> None:
    """batch 1..8 x seq 1..128 from one file, compared with eager; nothing compiles.

    The process has no C++ compiler at all (``no_compiler_env``: ``CC``/``CXX``
    are /bin/false, ``PATH`` holds only python, the Inductor cache is empty), so
    loading must use the kernels shipped in the file, on the lean path and on
    PyTorch's full path (``TORCH_PRECOMPILE_LEAN=0``). Also counted: C++
    builds (Inductor's CppBuilder) at load and while serving, Dynamo's counters.
    """
    path = gpt_dynamic[2]
    script = tmp_path / "serve.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, time
            import torch
            from torch._dynamo.utils import counters
            import torch._inductor.cpp_builder as cpp_builder
            from torch_precompile import GuardError, Precompile

            SEQS = {SEQS!r}
            builds = []
            original_build = cpp_builder.CppBuilder.build
            def counting_build(self, *a, **k):
                builds.append(self.get_target_file_path())
                return original_build(self, *a, **k)
            cpp_builder.CppBuilder.build = counting_build

            start = time.perf_counter()
            art = Precompile.load({str(path)!r})
            load_s = time.perf_counter() - start
            builds_at_load = len(builds)
            # From here on nothing may compile: make any attempt fail loudly.
            torch._inductor.config.cpp.cxx = ("/bin/false",)
            before = {{k: dict(v) for k, v in counters.items()}}
            outputs = {{}}
            start = time.perf_counter()
            with torch.no_grad():
                for b in range(1, 9):
                    for s in SEQS:
                        gen = torch.Generator().manual_seed(b * 1000 + s)
                        ids = torch.randint(0, 512, (b, s), generator=gen)
                        outputs[(b, s)] = (ids, art(ids))
            serve_s = time.perf_counter() - start
            after = {{k: dict(v) for k, v in counters.items()}}
            errors = {{}}
            for shape in [(9, 4), (2, 129)]:
                try:
                    with torch.no_grad():
                        art(torch.zeros(shape, dtype=torch.long))
                except GuardError as exc:
                    errors[str(shape)] = str(exc)
            # Eager reference, built only now (same seed, same weights).
            from tests.fixtures.models import build_gpt
            model = build_gpt()[0]
            with torch.no_grad():
                for (b, s), (ids, got) in outputs.items():
                    torch.testing.assert_close(got, model(ids), rtol=1e-4, atol=1e-4)
            print(json.dumps({{
                "calls": len(outputs), "load_s": load_s, "serve_s": serve_s,
                "loaded_as": type(art.compiled_function).__name__,
                "builds_at_load": builds_at_load, "builds_serving": len(builds) - builds_at_load,
                "counters_before": before, "counters_after": after, "errors": errors,
            }}))
            """
        )
    )
    env = no_compiler_env(tmp_path)
    if load_path == "full":
        env["TORCH_PRECOMPILE_LEAN"] = "0"
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("counters")}))
    want = {"fast": "LeanCompiledFunction", "full": "AOTCompiledFunction"}[load_path]
    assert res["loaded_as"] == want
    assert res["calls"] == 8 * len(SEQS)
    assert res["builds_at_load"] == 0 and res["builds_serving"] == 0
    assert res["counters_after"] == res["counters_before"], (
        "serving must not compile or trace anything"
    )
    # Dynamo traced nothing, AOTAutograd compiled nothing. (counters["inductor"] holds
    # the counts Inductor recorded at compile time and replays when a graph is loaded.)
    assert set(res["counters_after"]) <= {"inductor"}, res["counters_after"]
    assert "must be in [1, 8]" in res["errors"]["(9, 4)"]
    assert "must be in [1, 128]" in res["errors"]["(2, 129)"]


def test_size_oblivious_serves_batch_one(mlp_size_oblivious: tuple[Any, Any]) -> None:
    artifact, model = mlp_size_oblivious
    ranges = [g for g in artifact.guards if g.kind == "range"]
    batch_range = [g for g in ranges if g.dim == 0]
    assert len(batch_range) == 1, [g.expr for g in ranges]
    assert batch_range[0].min <= 1 and not batch_range[0].note
    for batch in (1, 3, 64):
        x = torch.randn(batch, 32)
        with torch.no_grad():
            torch.testing.assert_close(artifact(x), model(x))


def test_without_shipped_kernels_the_dynamic_load_needs_a_compiler(
    gpt_dynamic: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    """The control: the same file without its shipped kernels, in the same environment."""
    meta, sections = container.read_artifact(gpt_dynamic[2])
    for name in [n for n in sections if n.startswith("kernel/")] + ["lean"]:
        del sections[name]  # the lean path needs the kernels too
    stripped = tmp_path / "no_kernels.pt2"
    container.write_artifact(stripped, meta, sections)
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from torch_precompile import Precompile
            art = Precompile.load({str(stripped)!r})
            with torch.no_grad():
                art(torch.zeros(2, 16, dtype=torch.long))
            print("RAN")
            """
        )
    )
    env = no_compiler_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode != 0 and "RAN" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "InvalidCxxCompiler" in proc.stderr, proc.stderr[-2000:]
