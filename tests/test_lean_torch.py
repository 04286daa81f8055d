"""``torch-precompile serve`` and ``generate`` import torch with four submodules' bodies
deferred (torch_precompile_cli/lean_torch.py): each runs at its first use, and all of
them before a compiler's module, so that what uses them sees no difference.

Each check runs in a fresh process (the deferral acts on a coming ``import torch``);
test_serve.py checks that a server answering every kind of request never runs them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(source: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_HEAD = """
import json, sys
from torch_precompile_cli import lean_torch
first = lean_torch.import_torch()
import torch
import torch_precompile
def deferred():
    return [m for m in lean_torch.DEFERRED if isinstance(sys.modules.get(m), lean_torch._Deferred)]
out = {"first": first, "second": lean_torch.import_torch(), "after_import": deferred()}
out["seeded"] = torch.randn(3, generator=torch.Generator().manual_seed(7)).tolist()
"""


def test_each_deferred_module_runs_at_its_first_use_and_computes_as_eager() -> None:
    got = _run(
        _HEAD
        + """
normal = torch.distributions.Normal(torch.tensor(0.5), torch.tensor(2.0))
out["log_prob"] = normal.log_prob(torch.tensor(1.5)).item()
out["after_distributions"] = deferred()
nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
out["nested_sums"] = [t.sum().item() for t in nested.unbind()]
class M(torch.nn.Module):
    def forward(self, x):
        return x.sin() * 2
program = torch.export.export(M(), (torch.ones(3),))
x = torch.linspace(-1, 1, 3)
out["exported"] = (program.module()(x) - x.sin() * 2).abs().max().item()
out["after_export"] = deferred()
print(json.dumps(out))
"""
    )
    assert got["first"] is True and got["second"] is False  # torch imported: no second finder
    seeded = torch.randn(3, generator=torch.Generator().manual_seed(7)).tolist()
    assert got["seeded"] == seeded  # a generator object before any deferred body ran
    assert got["after_import"] == [
        "torch._meta_registrations", "torch.export", "torch.nested", "torch.distributions",
    ]  # fmt: skip
    expected = -0.5 * ((1.5 - 0.5) / 2.0) ** 2 - math.log(2.0) - 0.5 * math.log(2 * math.pi)
    assert got["log_prob"] == pytest.approx(expected, rel=1e-6)
    assert "torch.distributions" not in got["after_distributions"]
    assert got["nested_sums"] == [1.0, 3.0]
    assert got["exported"] == 0.0
    assert got["after_export"] == []  # export needs the meta kernels: all run by then


def test_a_compiler_import_runs_every_deferred_body_first() -> None:
    got = _run(
        _HEAD
        + """
import torch._dynamo
out["after_dynamo"] = deferred()
def f(x):  # under aot_eager every op runs on fake tensors: the meta kernels' work
    return torch.nn.functional.scaled_dot_product_attention(x, x, x).cumsum(-1)
x = torch.randn(1, 2, 4, 8)
out["diff"] = (torch.compile(f, backend="aot_eager", fullgraph=True)(x) - f(x)).abs().max().item()
print(json.dumps(out))
"""
    )
    assert got["after_import"] and got["after_dynamo"] == []
    assert got["diff"] < 1e-5
