"""PyTorch's own aot_compile flow (ugly.py) still works beside ours."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import ROOT

from torch_precompile import Precompile


def test_ugly_py_runs_unchanged() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ugly.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ugly.py: max |loaded - eager|" in proc.stdout and "(OK)" in proc.stdout


def test_torch_aot_compile_works_after_import_and_loads_through_precompile(tmp_path) -> None:
    def f(x):
        return torch.nn.functional.silu(x).sum(dim=-1)

    x = torch.randn(3, 5)
    # As ugly.py: torch 2.11 gives a compiled function aot_compile only with this flag.
    with torch._dynamo.config.patch(enable_aot_compile=True):
        fn = torch.compile(f, fullgraph=True).aot_compile(((x,), {}))
    torch.testing.assert_close(fn(x), f(x))
    path = tmp_path / "f.bin"
    fn.save_compiled_function(str(path))
    with open(path, "rb") as fh:
        torch.testing.assert_close(torch.compiler.load_compiled_function(fh)(x), f(x))
    torch.testing.assert_close(Precompile.load(path)(x), f(x))


def test_plain_torch_compile_is_unaffected() -> None:
    def g(x):
        return torch.cos(x) * 2

    x = torch.randn(6)
    torch.testing.assert_close(torch.compile(g)(x), g(x))
