"""The lean load keeps the compiler stack out of the process.

One small model is captured as an inference, a training, a dynamic-shape
artifact, a function with a closure, and a bundle of two variants (static
and dynamic). A fresh process with no C++ compiler loads each file, calls it
once (forward and backward for training), compares with eager, and then
checks that none of ``torch._dynamo``, ``torch._inductor.compile_fx``,
``sympy`` (nor AOTAutograd's runtime) was imported. ``torch-precompile
inspect`` names the load path of each variant, and an artifact that cannot
take the lean path says why, in one INFO line at load.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import no_compiler_env, run_script

from tests.fixtures.models import build_closure, build_dropout_mlp_train, build_tiny_mlp
from torch_precompile import Precompile
from torch_precompile import file as container
from torch_precompile.lean import pycode

HEAVY = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "sympy",
    "torch._functorch._aot_autograd.runtime_wrappers",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lean-modules")
    out: dict[str, Path] = {}
    model, (x,), _ = build_tiny_mlp()
    with torch.no_grad():
        Precompile.save(tmp / "inference.pt2", Precompile.compile(model, x))
        xd = x.clone()
        torch._dynamo.mark_dynamic(xd, 0, min=2, max=64)
        dynamic = Precompile.compile(model, xd)
        Precompile.save(tmp / "dynamic.pt2", dynamic)
        static4 = Precompile.compile(model, x[:4].clone())
        Precompile.save(tmp / "bundle.pt2", Precompile.precompile([static4, dynamic]))
        fn, args, _ = build_closure()
        Precompile.save(tmp / "closure.pt2", Precompile.compile(fn, args))
    train = build_tiny_mlp()[0].train()
    Precompile.save(tmp / "training.pt2", Precompile.compile(train, x.clone().requires_grad_()))
    drop, (xdrop,), _ = build_dropout_mlp_train()
    Precompile.save(tmp / "dropout.pt2", Precompile.compile(drop, xdrop))
    # Matmuls only: Inductor calls the library's kernels and ships none of its own.
    linears = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(3)])
    with torch.no_grad():
        Precompile.save(tmp / "linears.pt2", Precompile.compile(linears.eval(), x))
        xl = torch.randn(8, 64)
        torch.save((xl, linears(xl)), tmp / "linears_io.pt2")
    for name in ("inference", "dynamic", "bundle", "closure", "training", "dropout", "linears"):
        out[name] = tmp / f"{name}.pt2"
    out["linears_io"] = tmp / "linears_io.pt2"
    return out


CHECK = r"""
import logging, sys
import torch
from tests.fixtures import models
from torch_precompile import Precompile

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
d = dict(a.split("=", 1) for a in sys.argv[1:])
HEAVY = __HEAVY__
eager = models.build_tiny_mlp()[0]
# Not torch.testing.assert_close: it imports DTensor, which imports sympy.
def close(a, b):
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
with torch.no_grad():
    art = Precompile.load(d["inference"])
    x = torch.randn(8, 64)
    close(art(x), eager(x))
    art = Precompile.load(d["dynamic"])
    for n in (2, 5, 64):
        x = torch.randn(n, 64)
        close(art(x), eager(x))
    art = Precompile.load(d["bundle"])
    for n in (4, 9):
        x = torch.randn(n, 64)
        close(art(x), eager(x))
    fn, args, _ = models.build_closure()
    art = Precompile.load(d["closure"])
    close(art(*args), fn(*args))
    xl, want = torch.load(d["linears_io"])
    close(Precompile.load(d["linears"])(xl), want)
art = Precompile.load(d["training"])
x = torch.randn(8, 64, requires_grad=True)
out = art(x)
out.pow(2).sum().backward()
ex = x.detach().clone().requires_grad_()
eager.train()
eout = eager(ex)
eout.pow(2).sum().backward()
close(out, eout)
close(x.grad, ex.grad)
for name, p in art.named_parameters():
    close(p.grad, dict(eager.named_parameters())[name].grad)
loaded = [m for m in HEAVY if m in sys.modules]
assert not loaded, f"imported after load and a first call: {loaded}"
print("OK")
""".replace("__HEAVY__", repr(HEAVY))


def test_lean_load_imports_no_compiler(files: dict[str, Path], tmp_path: Path) -> None:
    """Every file, also one that ships no kernel (matmuls only: before, such a file
    loaded through PyTorch's full path though ``inspect`` said lean)."""
    with container.open_artifact(files["linears"]) as reader:
        assert "lean" in reader.names() and not any(n.startswith("kernel") for n in reader.names())
    args = [f"{k}={v}" for k, v in files.items() if k != "dropout"]
    proc = run_script(CHECK, *args, env=no_compiler_env(tmp_path))
    assert "OK" in proc.stdout
    assert "full path" not in proc.stdout, proc.stdout  # every one of them took the lean path


def _inspect(path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def test_inspect_names_the_load_path(files: dict[str, Path]) -> None:
    lean = "lean (shipped kernels"
    assert f"load path: {lean}" in _inspect(files["training"])
    bundle = _inspect(files["bundle"])
    assert f"variant 0: {lean}" in bundle and f"variant 1: {lean}" in bundle, bundle
    dropout = [ln for ln in _inspect(files["dropout"]).splitlines() if ln.startswith("load path")]
    assert dropout == [
        "load path: PyTorch's full path (training artifact: random ops (e.g. dropout) in "
        "the compiled graph)"
    ], dropout


REFUSED = r"""
import logging, sys, torch
from torch_precompile import Precompile
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
art = Precompile.load(sys.argv[1])
art(torch.randn(8, 32)).sum().backward()
print("OK")
"""


def test_refused_artifact_says_why_in_one_info_line(files: dict[str, Path], tmp_path: Path) -> None:
    proc = run_script(REFUSED, str(files["dropout"]), env=no_compiler_env(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if "full path" in ln]
    assert len(lines) == 1 and lines[0].startswith("INFO"), proc.stdout
    assert "random ops" in lines[0]


NO_COMPILE = r"""
import builtins, json, sys
compiled = []
_compile = builtins.compile
def counting(source, filename, *args, **kwargs):
    compiled.append(str(filename))
    return _compile(source, filename, *args, **kwargs)
builtins.compile = counting
import torch
from tests.fixtures import models
from torch_precompile import GuardError, Precompile
from torch_precompile.lean import guard_emit

emitted = []
_init = guard_emit.Emitter.__init__
def emitting(self, spec):
    emitted.append(1)
    _init(self, spec)
guard_emit.Emitter.__init__ = emitting

def close(a, b):
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
eager = models.build_tiny_mlp()[0]
art = Precompile.load(sys.argv[1])  # two variants
with torch.no_grad():
    for n in (4, 9):
        x = torch.randn(n, 64)
        close(art(x), eager(x))
    try:
        art(torch.randn(4, 64, dtype=torch.float64))  # no variant's guards hold
    except GuardError:
        refused = True
    else:
        refused = False
art = Precompile.load(sys.argv[2])  # a forward and a backward wrapper
x = torch.randn(8, 64, requires_grad=True)
art(x).pow(2).sum().backward()
ex = x.detach().clone().requires_grad_()
eager.train()(ex).pow(2).sum().backward()
close(x.grad, ex.grad)
skip = "<torch_precompile binder>"  # a few lines, made at load
print(json.dumps([f for f in compiled if f.startswith("<torch_precompile") and f != skip]))
print(json.dumps({"emitted": len(emitted), "refused": refused}))
"""


def test_a_load_compiles_no_guard_function_or_wrapper(files: dict[str, Path]) -> None:
    """The guard function and Inductor's wrappers were compiled at save, and the guard
    function written there too: a load on the same Python unmarshals them (writing
    and compiling them took most of a generator's load), the results are eager's,
    and an input no variant was built for is still refused."""
    proc = run_script(NO_COMPILE, files["bundle"], files["training"])
    *_, compiled, counts = proc.stdout.strip().splitlines()
    assert json.loads(compiled) == []
    assert json.loads(counts) == {"emitted": 0, "refused": True}


_SOURCE = "def f(x):\n    return x + 1\n"


def test_code_of_another_python_or_source_is_compiled_from_the_source() -> None:
    saved = pycode.compiled(_SOURCE, "<saved>")
    for stale, source in [
        (dict(saved, magic="00000000"), _SOURCE),  # another interpreter's bytecode
        (saved, _SOURCE.replace("+ 1", "+ 2")),  # a source the saved code is not of
        ({"magic": pycode.MAGIC, "sha256": saved["sha256"], "code": b"\x00"}, _SOURCE),
    ]:
        namespace: dict[str, Any] = {}
        exec(pycode.code_for(source, "<here>", stale), namespace)
        assert namespace["f"](1) == (3 if "+ 2" in source else 2)
    code = pycode.code_for(_SOURCE, "<here>", saved)  # the saved code, named where it runs
    namespace = {}
    exec(code, namespace)
    assert namespace["f"](1) == 2
    assert code.co_filename == namespace["f"].__code__.co_filename == "<here>"


def test_a_saved_emission_of_another_version_is_written_again(files: dict[str, Path]) -> None:
    """The guard function a save wrote is used by a load of the same version only; any
    other (or an unreadable one) is written again from the spec, the same function."""
    from torch_precompile.lean import guards

    art = Precompile.load(files["bundle"])
    function = art.variants[1].compiled_function
    loaded = function._artifacts.guard_manager.lean_guards
    tree = pickle.loads(function.lean_section)["lean_guards"]  # the saved guard tree
    written = guards.LeanGuards(tree)  # no saved code: written here
    assert written.source == loaded.source and "return False" in written.source
    assert written.emitted.tensor_checks == loaded.emitted.tensor_checks
    blob = guards.prepared(written)
    assert blob is not None
    saved = guards._saved_emission(blob)
    assert saved is not None
    assert (saved.source, saved.tensor_checks) == (written.source, written.emitted.tensor_checks)
    assert saved.consts.keys() == written.emitted.consts.keys()
    state_guard = torch._C._dynamo.guards.GlobalStateGuard
    for name, value in saved.consts.items():  # a global state guard: equal as its state
        want = written.emitted.consts[name]
        if isinstance(value, state_guard):
            value, want = value.__getstate__(), want.__getstate__()
        assert value == want, name
    other = pickle.dumps({**pickle.loads(blob), "version": guards.EMITTED_VERSION + 1})
    for stale in (other, b"\x80\x05junk", None):
        assert guards._saved_emission(stale) is None
        again = guards.LeanGuards(tree, None, stale)
        assert again.source == written.source


def test_a_guard_on_a_methods_type_is_kept_with_the_emission() -> None:
    """A method's type (a config's bound method, GPT-2 on torch 2.11) is read by name at
    load, not pickled with the constants (it cannot be): the saved emission holds."""
    from torch_precompile.lean import guards

    leaf = {"source": "L['f']", "leaves": [["type", "method"]], "children": []}
    spec = {"source": "L", "leaves": [], "children": [[["item", "f"], leaf]]}
    blob = guards.prepared(guards.LeanGuards(spec))
    assert blob is not None
    loaded = guards.LeanGuards(spec, None, blob)
    assert guards._saved_emission(blob) is not None

    class Config:
        def get_text_config(self) -> None:
            return None

    assert loaded.check({"f": Config().get_text_config})
    assert not loaded.check({"f": Config.get_text_config})  # a plain function
