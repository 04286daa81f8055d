"""Cold start: a saved CPU artifact loads and runs with no compiler and empty caches.

The session's transformer artifact (``staged`` in conftest) is reused. The
fresh-process tests run a script with ``CC``/``CXX`` pointing at ``/bin/false``,
a ``PATH`` holding only
``python`` (so no ``gcc``/``g++``/``cc``/``c++`` can be found) and an empty
``TORCHINDUCTOR_CACHE_DIR``; the script compares with eager and exits non-zero
on any mismatch. PyTorch's full path (``TORCH_PRECOMPILE_LEAN=0``) runs in
that environment too, with the shipped kernels; with them turned off
(``TORCH_PRECOMPILE_SHIPPED_KERNELS=0``) it fails: the control.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import no_compiler_env

from tests.fixtures.models import build_scalar_fn, build_tiny_mlp
from torch_precompile import GuardError, Precompile
from torch_precompile import file as container

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(staged: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The session's transformer artifact (conftest), with inputs and eager outputs on disk."""
    root = tmp_path_factory.mktemp("coldstart")
    other = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        expected_other = staged.model(other)
    io = {
        "args": (staged.example,),
        "expected": staged.expected,
        "other": other,
        "expected_other": expected_other,
    }
    torch.save(io, root / "io.pt")
    return {"root": root, "artifact": staged.path, "io": root / "io.pt"}


def _run(root: Path, body: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = root / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )


def _kernel_sections(sections: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in sections.items() if name.startswith("kernel/")}


def test_saved_artifact_ships_kernel_binaries(saved: dict[str, Path]) -> None:
    meta, sections = container.read_artifact(saved["artifact"])
    assert "lean" in sections
    # One section per kernel, named by its key: one level of sections, no nested index.
    kernels = {n[len("kernel/") :]: v for n, v in sections.items() if n.startswith("kernel/")}
    assert len(kernels) >= 1
    for data in kernels.values():
        assert bytes(data[:4]) == b"\x7fELF"  # shared objects, not C++ source
    assert all(re.fullmatch("[0-9a-f]{64}", key) for key in kernels)  # SHA-256 of each source
    assert meta["sizes"]["kernels"] == sum(len(v) for v in kernels.values())


def test_load_needs_no_compiler(saved: dict[str, Path]) -> None:
    root = saved["root"]
    env = no_compiler_env(root)
    assert shutil.which("gcc", path=env["PATH"]) is None
    assert shutil.which("g++", path=env["PATH"]) is None
    assert shutil.which("c++", path=env["PATH"]) is None
    assert shutil.which("cc", path=env["PATH"]) is None
    body = f"""
        import os, sys
        import torch
        from torch_precompile import GuardError, Precompile
        io = torch.load({str(saved["io"])!r})
        art = Precompile.load({str(saved["artifact"])!r})
        with torch.no_grad():
            out = art(*io["args"])
            out2 = art(io["other"])
        torch.testing.assert_close(out, io["expected"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out2, io["expected_other"], rtol=1e-4, atol=1e-4)
        assert type(art.compiled_function).__name__ == "LeanCompiledFunction"
        compile_stack = (
            "torch._inductor.codecache", "torch._inductor.compile_fx",
            "torch._inductor.async_compile", "torch._inductor.select_algorithm",
            "torch._functorch._aot_autograd.aot_autograd_result",
        )
        heavy = [m for m in compile_stack if m in sys.modules]
        assert not heavy, heavy
        # The lean guards checked both calls; Dynamo was never imported.
        assert "torch._dynamo" not in sys.modules
        try:
            with torch.no_grad():
                art(torch.randint(0, 1000, (3, 32)))
        except GuardError as exc:
            assert "ids" in str(exc), exc
        else:
            raise SystemExit("a wrong input shape passed the guards")
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert os.listdir(cache) == [], os.listdir(cache)
        print("OK")
    """
    proc = _run(root, body, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")


def test_full_path_loads_the_shipped_kernels(saved: dict[str, Path], tmp_path: Path) -> None:
    """Without the lean path, PyTorch's own deserialization runs with the shipped kernels;
    saving that artifact again (still no compiler) ships the same kernels and fast path."""
    root = saved["root"]
    env = no_compiler_env(root)
    env["TORCH_PRECOMPILE_LEAN"] = "0"
    again = tmp_path / "again.pt"
    body = f"""
        import torch
        from torch_precompile import Precompile
        io = torch.load({str(saved["io"])!r})
        art = Precompile.load({str(saved["artifact"])!r})
        assert type(art.compiled_function).__name__ == "AOTCompiledFunction"
        with torch.no_grad():
            torch.testing.assert_close(art(*io["args"]), io["expected"], rtol=1e-4, atol=1e-4)
        Precompile.save({str(again)!r}, art)
        print("OK")
    """
    proc = _run(root, body, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("OK")
    _, sections = container.read_artifact(again)
    _, original = container.read_artifact(saved["artifact"])
    assert _kernel_sections(sections) == _kernel_sections(original)
    assert "lean" in sections


def test_without_shipped_kernels_load_needs_the_compiler(saved: dict[str, Path]) -> None:
    """The control experiment: PyTorch's own path, in the same environment, tries to compile."""
    root = saved["root"]
    env = no_compiler_env(root)
    env["TORCH_PRECOMPILE_LEAN"] = "0"
    env["TORCH_PRECOMPILE_SHIPPED_KERNELS"] = "0"
    body = f"""
        import torch
        from torch_precompile import Precompile
        io = torch.load({str(saved["io"])!r})
        art = Precompile.load({str(saved["artifact"])!r})
        with torch.no_grad():
            art(*io["args"])
        print("RAN")
    """
    proc = _run(root, body, env)
    assert proc.returncode != 0 and "RAN" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "InvalidCxxCompiler" in proc.stderr, proc.stderr[-2000:]


def test_fast_loaded_artifact_saves_again(saved: dict[str, Path], tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    copy = tmp_path / "again.pt"
    body = f"""
        import torch
        from torch_precompile import Precompile
        io = torch.load({str(saved["io"])!r})
        art = Precompile.load({str(saved["artifact"])!r})
        assert type(art.compiled_function).__name__ == "LeanCompiledFunction"
        Precompile.save({str(copy)!r}, art)
        again = Precompile.load({str(copy)!r})
        with torch.no_grad():
            torch.testing.assert_close(again(*io["args"]), io["expected"], rtol=1e-4, atol=1e-4)
        print("OK")
    """
    proc = _run(tmp_path, body, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, sections = container.read_artifact(copy)
    _, original = container.read_artifact(saved["artifact"])
    assert _kernel_sections(sections) == _kernel_sections(original)


def test_in_process_load_matches_eager(saved: dict[str, Path]) -> None:
    io = torch.load(saved["io"])
    art = Precompile.load(saved["artifact"])
    with torch.no_grad():
        torch.testing.assert_close(art(*io["args"]), io["expected"], rtol=1e-4, atol=1e-4)
        with pytest.raises(GuardError):
            art(io["args"][0].to(torch.int32))


def _perturbations() -> dict[str, Any]:
    """Changes to the inputs or the (stand-in) model that break a guard Dynamo recorded."""

    def add_block(m: torch.nn.Module) -> None:
        # The stand-in is a tree of plain nn.Modules: add a child as ModuleList.append would.
        m.blocks.add_module("2", copy.deepcopy(m.blocks.get_submodule("0")))

    def set_heads(m: torch.nn.Module) -> None:
        m.get_submodule("blocks.0.attn").n_heads = 8

    def override_forward(m: torch.nn.Module) -> None:
        m.head.forward = lambda x: x

    def freeze_head(m: torch.nn.Module) -> None:
        m.head.weight.requires_grad_(False)

    def resize_head(m: torch.nn.Module) -> None:
        m.head.weight = torch.nn.Parameter(torch.randn(1000, 128))

    return {
        "ids of another shape": (None, lambda ids: torch.randint(0, 1000, (3, 32))),
        "ids of another dtype": (None, lambda ids: ids.to(torch.int32)),
        "ids transposed (other strides)": (None, lambda ids: ids.t().contiguous().t()),
        "a third block": (add_block, None),
        "n_heads changed": (set_heads, None),
        "train mode": (lambda m: m.train(), None),
        "forward overridden on an instance": (override_forward, None),
        "a parameter frozen": (freeze_head, None),
        "a parameter of another shape": (resize_head, None),
    }


@pytest.mark.parametrize("tensor_check", ["native", "python"])
def test_light_guards_never_pass_what_dynamo_rejects(
    saved: dict[str, Path], tensor_check: str
) -> None:
    """The lean check is a sufficient condition: light passes => Dynamo's guards pass.

    Tensors are checked by PyTorch's C++ ``TensorGuards`` and, where that
    fails, in Python; both must reject every perturbation on their own.
    """
    io = torch.load(saved["io"])
    (ids,) = io["args"]

    def load() -> Any:
        loaded = Precompile.load(saved["artifact"])
        light = loaded.runtime.guard_manager.lean_guards
        assert light is not None and light._tensor_guards is not None
        if tensor_check == "python":
            light._tensor_guards = None  # the Python check alone
        return loaded

    art = load()
    tiered = art.runtime.guard_manager
    with torch.no_grad():
        f_locals = {"self": art.module, "ids": ids}
        assert tiered.lean_guards.check(f_locals) and tiered.full.check(f_locals)
        for name, (mutate_model, new_ids) in _perturbations().items():
            fresh = load()
            if mutate_model is not None:
                mutate_model(fresh.module)
            x = new_ids(ids) if new_ids is not None else ids
            f_locals = {"self": fresh.module, "ids": x}
            guards = fresh.runtime.guard_manager
            light, full = guards.lean_guards.check(f_locals), guards.full.check(f_locals)
            assert not light, name
            assert not full, f"{name}: Dynamo's guards accept it (test premise)"
            with pytest.raises(GuardError):
                fresh(x)
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            f_locals = {"self": art.module, "ids": ids}
            assert not tiered.lean_guards.check(f_locals)
            assert not tiered.full.check(f_locals)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(art(ids), io["expected"], rtol=1e-4, atol=1e-4)


def test_light_guards_on_python_scalar_arguments(tmp_path: Path) -> None:
    """Guards on Python values of the arguments (Dynamo specialises on them) and on a function."""
    fn, (x, alpha, n, flag), _ = build_scalar_fn()
    with torch.no_grad():
        artifact = Precompile.compile(fn, (x, alpha, n, flag))
        expected = fn(x, alpha, n, flag)
    Precompile.save(tmp_path / "scalar.pt", artifact)
    loaded = Precompile.load(tmp_path / "scalar.pt")
    guards = loaded.runtime.guard_manager
    assert guards.lean_guards is not None
    variants = [
        (x, 0.7, n, flag),
        (x, alpha, 4, flag),
        (x, alpha, n, False),
        (x, 1, n, flag),  # an int where a float was captured
        (x, alpha, 3.0, flag),
        (x, alpha, n, 1),
        (x.double(), alpha, n, flag),
        (torch.randn(6), alpha, n, flag),
    ]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, alpha, n, flag), expected)
        f_locals = {"x": x, "alpha": alpha, "n": n, "flag": flag}
        assert guards.lean_guards.check(f_locals)
        for args in variants:
            f_locals = dict(zip(("x", "alpha", "n", "flag"), args))
            assert not guards.lean_guards.check(f_locals), args
            assert not guards.full.check(f_locals), args
            with pytest.raises(GuardError):
                loaded(*args)


def test_import_adds_no_compiler_modules() -> None:
    """``import torch_precompile`` costs little over ``import torch``: beside its own modules
    it imports only the standard library's (none of the compiler stack, sympy, filelock),
    and takes a small share of the time."""
    # The full collection of torch's heap that ``import torch`` leaves due (0.15-0.2 s
    # on 2 cores) runs before ours is timed: whichever import allocates next pays for
    # it, and a module more or less of ours decided whether it was counted as ours.
    body = """
        import gc, json, sys, time
        t0 = time.perf_counter()
        import torch
        t1 = time.perf_counter()
        gc.collect()
        before = set(sys.modules)
        t2 = time.perf_counter()
        import torch_precompile
        t3 = time.perf_counter()
        new = sorted(set(sys.modules) - before)
        print(json.dumps({"torch": t1 - t0, "ours": t3 - t2, "new": new}))
    """
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: bytecode cached
    for _ in range(2):  # the first run may write the bytecode caches
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(body)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Beside its own modules, only the standard library's: no torch submodule (Dynamo,
    # Inductor), no other library (sympy, filelock, triton).
    outside = [
        m
        for m in report["new"]
        if not m.startswith("torch_precompile") and m.split(".")[0] not in sys.stdlib_module_names
    ]
    assert not outside, outside
    # 0.1 s on an idle machine; a share of import torch keeps it meaningful on a busy one.
    assert report["ours"] < max(0.1, 0.1 * report["torch"]), report


def test_kernel_directories_unused_for_two_weeks_are_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that adds a kernel directory prunes the other artifacts' that no load used
    for two weeks; a load whose directory is there already scans nothing."""
    import tempfile
    import time

    from torch_precompile.lean import kernels as shipped

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    section = {"k": b"not really a shared object"}
    first = Path(shipped.kernel_dir(section))
    root = first.parent
    stale, recent = root / ("5" * 24), root / ("7" * 24)  # named as kernel_dir names them
    for d in (stale, recent):
        d.mkdir(mode=0o700)
        (d / "kx.so").write_bytes(b"x")
    old = time.time() - shipped.KERNEL_DIR_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    os.utime(first, (old, old))  # stale too, but it is the one being loaded
    again = Path(shipped.kernel_dir(section))
    assert again == first and first.is_dir()
    assert first.stat().st_mtime > old + 60  # marked as used
    assert stale.exists()  # nothing was added: nothing scanned
    other = Path(shipped.kernel_dir({"k": b"another artifact's kernel"}))
    assert other.is_dir() and other != first
    assert not stale.exists()
    assert (recent / "kx.so").exists() and first.is_dir()


def test_calls_under_inference_mode(saved: dict[str, Path]) -> None:
    """Under ``torch.inference_mode()`` the lean check decides as Dynamo does: normal
    tensors pass (no Dynamo import needed), inference tensors are refused with a hint."""
    io = torch.load(saved["io"])
    (ids,) = io["args"]
    art = Precompile.load(saved["artifact"])
    guards = art.runtime.guard_manager
    assert guards.lean_guards is not None
    with torch.inference_mode():
        f_locals = {"self": art.module, "ids": ids}
        assert guards.lean_guards.check(f_locals)
        # Dynamo's own manager, rebuilt here under inference mode: torch 2.13 recomputes
        # the expected dispatch keys under the building thread's state and accepts;
        # 2.14 keeps the capture's keys and refuses (torch.compile would recompile).
        # The lean check accepts on both: the inference graph computes the same values.
        assert guards.full.check(f_locals) == (torch.__version__ < "2.14")
        torch.testing.assert_close(art(ids), io["expected"], rtol=1e-4, atol=1e-4)
        made_here = ids.clone()
        assert made_here.is_inference()
        f_locals = {"self": art.module, "ids": made_here}
        assert not guards.lean_guards.check(f_locals)
        assert not guards.full.check(f_locals)
        with pytest.raises(GuardError, match=r"inference tensor .* capture under"):
            art(made_here)


def test_artifact_captured_under_inference_mode(tmp_path: Path) -> None:
    """A capture under ``torch.inference_mode()`` serves inference tensors there, on the
    lean check; a call with normal tensors outside says where it was captured."""
    model, (x,), _ = build_tiny_mlp()
    with torch.inference_mode():
        x_inf = x.clone()
        artifact = Precompile.compile(model, x_inf)
        expected = model(x_inf)
    Precompile.save(tmp_path / "inference_mode.pt", artifact)
    loaded = Precompile.load(tmp_path / "inference_mode.pt")
    guards = loaded.runtime.guard_manager
    assert guards.lean_guards is not None
    with torch.inference_mode():
        x_here = x.clone()
        assert guards.lean_guards.check({"self": loaded.module, "x": x_here})
        # Dynamo's manager, built here as the lean path builds it on need, agrees.
        assert guards.full.check({"self": loaded.module, "x": x_here})
        torch.testing.assert_close(loaded(x_here), expected)
    with torch.no_grad(), pytest.raises(GuardError, match=r"captured? .*inference_mode"):
        loaded(x)

    # Bundled with a no_grad capture, lean-loaded: each kind of call finds its variant.
    with torch.no_grad():
        plain = Precompile.compile(model, x)
    Precompile.save(tmp_path / "both.pt", Precompile.precompile([plain, artifact]))
    both = Precompile.load(tmp_path / "both.pt")
    assert all(type(v.compiled_function).__name__ == "LeanCompiledFunction" for v in both.variants)
    with torch.no_grad():
        torch.testing.assert_close(both(x), expected)
    with torch.inference_mode():
        torch.testing.assert_close(both(x.clone()), expected)
