"""CPU training artifacts on the lean load: Inductor's forward and backward run
by an ``autograd.Function`` without Dynamo, Inductor's compiler, AOTAutograd or
sympy.

Each model (the reference transformer, dropout 0, and a small MLP whose input
requires grad) is captured once with grad enabled and saved. A fresh process
with no C++ compiler loads it with ``model=`` and standalone, checks that
outputs and every gradient equal eager's, that SGD steps follow eager's losses
and that none of the compiler modules was imported. A model with dropout in
train mode cannot take the lean path: it loads through PyTorch's full path,
still trains, and ``load`` says why at INFO.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import no_compiler_env, run_script  # noqa: E402

from tests.fixtures.models import build_dropout_mlp_train, build_tiny_mlp, build_transformer  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile import file as container  # noqa: E402

# ``import torch`` itself (2.13) imports the package ``torch._functorch._aot_autograd``
# and its ``utils``; AOTAutograd's runtime is what the lean load must not import.
HEAVY = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "sympy",
    "torch._functorch._aot_autograd.runtime_wrappers",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._functorch.aot_autograd",
)

# Run in a fresh process: argv = path, builder name, "model" | "standalone", input kind.
CHECK = r"""
import sys, torch
AOT_AT_IMPORT = {m for m in sys.modules if m.startswith("torch._functorch._aot_autograd")}
import torch.nn.functional as F
from tests.fixtures import models
from torch_precompile import Precompile

path, builder, how, kind = sys.argv[1:5]
HEAVY = __HEAVY__

def inputs():
    torch.manual_seed(1)
    if kind == "ids":
        return (torch.randint(0, 1000, (2, 32)),)
    return (torch.randn(8, 64).requires_grad_(True),)

def loss_of(out, seed=2):
    g = torch.Generator().manual_seed(seed)
    if out.dim() == 3:
        target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return (out * torch.randn(out.shape, generator=g)).sum()

def build():
    return getattr(models, builder)()[0].train()

eager = build()
model = build() if how == "model" else None
art = Precompile.load(path, model=model)
params = dict(model.named_parameters()) if model is not None else dict(art.named_parameters())
args = inputs()
out = art(*args)
assert out.grad_fn is not None
loss_of(out).backward()
loaded = sorted(m for m in HEAVY if m in sys.modules)
loaded += sorted(
    m for m in sys.modules
    if m.startswith("torch._functorch._aot_autograd") and m not in AOT_AT_IMPORT
)
assert not loaded, f"imported after load + forward + backward: {loaded}"

eargs = inputs()
eout = eager(*eargs)
loss_of(eout).backward()
torch.testing.assert_close(out, eout, rtol=1e-4, atol=1e-5)
eparams = dict(eager.named_parameters())
assert params.keys() == eparams.keys(), (sorted(params), sorted(eparams))
for name, p in eparams.items():
    assert params[name].grad is not None, f"no gradient reached {name}"
    torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
if args[0].requires_grad:
    torch.testing.assert_close(args[0].grad, eargs[0].grad, rtol=1e-4, atol=1e-5)

opt = torch.optim.SGD(list(params.values()), lr=0.05)
eopt = torch.optim.SGD(eager.parameters(), lr=0.05)
losses, elosses = [], []
for step in range(4):
    for o, m, ls in ((opt, art, losses), (eopt, eager, elosses)):
        o.zero_grad()
        loss = loss_of(m(*inputs()), seed=10 + step)
        loss.backward()
        o.step()
        ls.append(loss.item())
torch.testing.assert_close(torch.tensor(losses), torch.tensor(elosses), rtol=1e-4, atol=1e-5)
print("OK", losses)
""".replace("__HEAVY__", repr(HEAVY))


def _capture(build, args, path: Path) -> Path:
    model = build()[0].train()
    assert torch.is_grad_enabled()
    d = Precompile.dynamo(model, args)
    i = Precompile.inductor(Precompile.aot_autograd(d))
    art = Precompile.precompile(i)
    assert art.training
    Precompile.save(path, art, d.bytecode, i.guards)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lean-train")
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 32))
    torch.manual_seed(1)
    x = torch.randn(8, 64).requires_grad_(True)
    return {
        "transformer": _capture(build_transformer, (ids,), tmp / "transformer.pt2"),
        "mlp": _capture(build_tiny_mlp, (x,), tmp / "mlp.pt2"),
        "dropout": _capture(build_dropout_mlp_train, (torch.randn(8, 32),), tmp / "drop.pt2"),
    }


CASES = {"transformer": ("build_transformer", "ids"), "mlp": ("build_tiny_mlp", "x")}


@pytest.mark.parametrize("how", ["model", "standalone"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_lean_training_load(files: dict[str, Path], name: str, how: str, tmp_path: Path) -> None:
    path = files[name]
    _, sections = container.read_artifact(path)
    assert "lean" in sections, "a plain CPU training artifact saves a lean section"
    builder, kind = CASES[name]
    proc = run_script(CHECK, str(path), builder, how, kind, env=no_compiler_env(tmp_path))
    assert "OK" in proc.stdout


DROPOUT = r"""
import logging, sys, torch
from tests.fixtures import models
from torch_precompile import Precompile

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
model = models.build_dropout_mlp_train()[0]
art = Precompile.load(sys.argv[1], model=model)
x = torch.randn(8, 32)
out = art(x)
out.pow(2).mean().backward()
assert all(p.grad is not None for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(0)
first = None
for _ in range(5):
    opt.zero_grad()
    loss = art(x).pow(2).mean()
    loss.backward()
    opt.step()
    first = loss.item() if first is None else first
assert loss.item() < first, (first, loss.item())
print("OK")
"""


def test_dropout_takes_full_path(files: dict[str, Path], tmp_path: Path) -> None:
    path = files["dropout"]
    meta, sections = container.read_artifact(path)
    assert "lean" not in sections
    assert "random ops" in meta["variants"][0]["lean_refusal"]
    proc = run_script(DROPOUT, str(path), env=no_compiler_env(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if "full path" in ln]
    assert len(lines) == 1 and lines[0].startswith("INFO"), proc.stdout
    assert "random ops" in lines[0]
    assert "OK" in proc.stdout
