"""Graphs that write their inputs or return views of them load lean.

Three artifacts: one decoding step of attention with a static KV cache (the
graph writes two cache buffers and a step counter in place), a function that
returns its input and views of it and doubles another input in place, and a
ConvNet in training mode (BatchNorm updates its running statistics in place).
A fresh process with no C++ compiler loads each, runs it beside eager for
several steps, and compares outputs, the written buffers, the aliasing of
the outputs, version counters and gradients; none of Dynamo, Inductor's
compiler, sympy or AOTAutograd's runtime is imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import no_compiler_env, run_script

from tests.fixtures import models
from torch_precompile import Precompile


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lean-mutation")
    with torch.no_grad():
        model, args, _ = models.build_kv_cache_step()
        Precompile.save(tmp / "kv.pt2", Precompile.compile(model, args))
        fn, args, _ = models.build_view_outputs()
        Precompile.save(tmp / "views.pt2", Precompile.compile(fn, args))
    model, args, _ = models.build_convnet_train()
    Precompile.save(tmp / "bn.pt2", Precompile.compile(model, args))
    return {name: tmp / f"{name}.pt2" for name in ("kv", "views", "bn")}


CHECK = r"""
import logging, sys
import torch
from tests.fixtures import models
from torch_precompile import Precompile

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
d = dict(a.split("=", 1) for a in sys.argv[1:])
HEAVY = ("torch._dynamo", "torch._inductor.compile_fx", "sympy",
         "torch._functorch._aot_autograd.runtime_wrappers")
# Not torch.testing.assert_close: it imports DTensor, which imports sympy.
def close(a, b, rtol=1e-4, atol=1e-5):
    assert a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol), (a - b).abs().max()

# The KV cache: the loaded model's cache and step counter advance as eager's,
# whether it runs on the file's weights or on the caller's module.
for how in ("standalone", "model"):
    live = models.build_kv_cache_step()[0]
    art = Precompile.load(d["kv"], model=live) if how == "model" else Precompile.load(d["kv"])
    eager = models.build_kv_cache_step()[0]
    buffers = dict((art if how == "standalone" else live).named_buffers())
    with torch.no_grad():
        for step in (0, 1, 2, 5):
            x, pos = torch.randn(1, 1, 32), torch.tensor([step])
            close(art(x, pos), eager(x, pos))
            close(buffers["k_cache"], eager.k_cache)
            close(buffers["v_cache"], eager.v_cache)
            assert int(buffers["steps"]) == int(eager.steps), (buffers["steps"], eager.steps)
    assert int(eager.steps) == 4

# Outputs that are the input or views of it are views of the caller's tensor,
# at any offset (16-byte aligned or not), as eager's are.
fn = models.build_view_outputs()[0]
art = Precompile.load(d["views"])
for offset in (0, 1, 8):
    flat = torch.randn(64)
    x, scale = flat[offset : offset + 32].view(4, 8), torch.rand(8)
    xe, scale_e = x.clone(), scale.clone()
    version = scale._version
    out, ref = art(x, scale), fn(xe, scale_e)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape and o.stride() == r.stride()
        assert torch.equal(o, r)
    close(scale, scale_e)
    assert scale._version > version, "autograd sees the in-place write"
    assert out[0] is x
    assert out[1]._base is x._base and out[1].data_ptr() == x.data_ptr()
    assert out[2].data_ptr() == x[1].data_ptr() and out[3].data_ptr() == x.data_ptr()
    out[2].fill_(7.0)
    assert (x[1] == 7.0).all(), "writing the view writes the caller's tensor"

# Training with BatchNorm: running statistics move as eager's; gradients match.
model, eager = models.build_convnet_train()[0], models.build_convnet_train()[0]
art = Precompile.load(d["bn"], model=model)
for _ in range(2):
    x = torch.randn(2, 3, 32, 32)
    out = art(x)
    out.sum().backward()
    ref = eager(x)
    ref.sum().backward()
    close(out, ref)
for name in ("bn1", "bn2"):
    close(getattr(model, name).running_mean, getattr(eager, name).running_mean)
    close(getattr(model, name).running_var, getattr(eager, name).running_var)
    assert int(getattr(model, name).num_batches_tracked) == 2
for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
    close(p.grad, q.grad, rtol=1e-3, atol=1e-4)

loaded = [m for m in HEAVY if m in sys.modules]
assert not loaded, f"imported after load and calls: {loaded}"
print("OK")
"""


def test_mutating_and_aliasing_graphs_load_lean(files: dict[str, Path], tmp_path: Path) -> None:
    proc = run_script(CHECK, *[f"{k}={v}" for k, v in files.items()], env=no_compiler_env(tmp_path))
    assert "OK" in proc.stdout
    assert "full path" not in proc.stdout and "refused" not in proc.stdout, proc.stdout


def test_inspect_names_the_lean_path(files: dict[str, Path]) -> None:
    for path in files.values():
        out = subprocess.run(
            [sys.executable, "-m", "torch_precompile", "inspect", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "load path: lean (shipped kernels" in out, out
