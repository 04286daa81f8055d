"""``PrecompiledArtifact.to_python``: the generated module runs the artifact as plain Python.

Each artifact is compiled once: a ConvNet (parameters and buffers as graph
inputs, a tensor out) and a plain function with keyword-only arguments, a
Python value it specialises on and a nested dict/list/tuple output; their
modules are imported in a fresh process and compared with eager. Then a model
returning a dataclass, and a training artifact whose module's gradients are
compared with eager's.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.fixtures.models import (
    MultiOutput,
    build_convnet,
    build_dataclass_output,
    build_dropout_mlp,
    build_nested_fn,
)
from torch_precompile import GuardError, Precompile
from torch_precompile.runtime.pythonify import _output
from torch_precompile.runtime.signature import first_opaque
from torch_precompile.stages import output_structure as _output_structure

REPO = str(Path(__file__).resolve().parents[1])


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "check.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300
    )


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model, args, _ = build_convnet()
    with torch.no_grad():
        artifact = Precompile.compile(model, args)
    unsaved = dataclasses.replace(artifact, _origin={})  # never saved: no file to name
    root = tmp_path_factory.mktemp("pythonify_convnet")
    Precompile.save(root / "convnet.pt", artifact)
    source = artifact.to_python(root / "convnet_gen.py")
    return {"artifact": artifact, "unsaved": unsaved, "root": root, "source": source, "args": args}


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory) -> dict:
    fn, args, kwargs = build_nested_fn()
    # Captured with grad enabled but nothing requiring grad: an inference artifact that
    # runs in grad mode (the ConvNet's runs under no_grad): both branches of the module.
    assert torch.is_grad_enabled()
    artifact = Precompile.compile(fn, args, kwargs)
    assert not artifact.training
    root = tmp_path_factory.mktemp("pythonify_nested")
    Precompile.save(root / "nested.pt", artifact)
    source = artifact.to_python(root / "nested_gen.py")
    return {
        "artifact": artifact,
        "root": root,
        "source": source,
        "fn": fn,
        "args": args,
        "kwargs": kwargs,
    }


# ------------------------------------------------------------- the source


def test_module_shows_guards_extraction_call_and_output(convnet: dict) -> None:
    src = convnet["source"]
    root = convnet["root"]
    assert f"ARTIFACT_PATH = {str(root / 'convnet.pt')!r}" in src
    assert "\ndef forward(x):\n" in src
    # Guards as plain ifs with the guard's message.
    assert "if x.shape != (2, 3, 32, 32):" in src
    assert "if x.dtype != torch.float32:" in src
    assert "input 'x': expected shape (2, 3, 32, 32), got {tuple(x.shape)}; capture with" in src
    assert "if torch.is_grad_enabled():\n        # Captured under torch.no_grad()." in src
    # Guards on weights, checked once at import, as the same plain ifs.
    assert "if PARAMS['fc.weight'].shape != (10, 16):" in src
    assert "if MODEL.stem.bias is not None:" in src
    # Argument extraction: where each graph input comes from, in the graph's order.
    assert "arg0  = PARAMS['stem.weight']" in src
    assert "# parameter 'stem.weight'  <- L['self']._modules['stem']._parameters['weight']" in src
    assert "arg1  = x " in src
    assert "arg3  = BUFFERS['bn1.running_mean']" in src
    # The compiled call and the output.
    args = ", ".join(f"arg{i}" for i in range(14))
    assert f"graph_out = COMPILED_GRAPH({args})" in src
    assert "return graph_out[0]" in src
    assert "PARTS.dynamo_fn" not in src  # no fallback for a plain tensor output
    assert (root / "convnet_gen.py").read_text() == src


def test_nested_output_is_rebuilt_as_plain_code(nested: dict) -> None:
    src = nested["source"]
    assert "\ndef forward(x, y, *, scale=1.0, bias=None):\n" in src
    assert (
        "return {'sum': graph_out[0], 'parts': [graph_out[1], (graph_out[2], graph_out[3])]}" in src
    )
    assert "if plain(scale) != 2.0:" in src
    assert (
        "if not torch.is_grad_enabled():\n        # Runs in the grad mode it was captured in" in src
    )
    assert "MODEL" in src and "PARAMS['" not in src  # a function: no parameters to extract


def test_to_python_needs_a_file(convnet: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Save the artifact first"):
        convnet["unsaved"].to_python(tmp_path / "x.py")
    with pytest.raises(FileNotFoundError):
        convnet["unsaved"].to_python(tmp_path / "x.py", artifact_path=tmp_path / "missing.pt")
    assert not (tmp_path / "x.py").exists()


# ------------------------------------------------------ fresh processes


def test_convnet_module_matches_eager_in_a_fresh_process(convnet: dict, tmp_path: Path) -> None:
    gen = convnet["root"] / "convnet_gen.py"
    proc = _run(
        f"""
        import importlib.util, torch
        from tests.fixtures.models import build_convnet
        from torch_precompile import GuardError

        spec = importlib.util.spec_from_file_location("gen", {str(gen)!r})
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        model, (x,), _ = build_convnet()  # seed 0: the weights the artifact was compiled with
        for batch in (x, torch.randn(2, 3, 32, 32)):
            with torch.no_grad():
                torch.testing.assert_close(gen.forward(batch), model(batch))

        def error(fn, *args):
            try:
                fn(*args)
            except GuardError as exc:
                return str(exc)
            raise SystemExit(f"no GuardError from {{fn}}")

        # A broken guard: the generated ifs raise the artifact's own message.
        with torch.no_grad():
            for bad in (torch.randn(3, 3, 32, 32), x.double(), torch.randn(2, 3, 32)):
                mine, theirs = error(gen.forward, bad), error(gen.ARTIFACT, bad)
                assert mine == theirs, (mine, theirs)
                print("GUARD", mine)
        # Grad enabled with weights that require grad: the inference artifact refuses.
        mine, theirs = error(gen.forward, x), error(gen.ARTIFACT, x)
        assert mine == theirs, (mine, theirs)
        print("GRAD", mine)
        print("OK")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "GUARD input 'x': expected shape (2, 3, 32, 32), got (3, 3, 32, 32); capture with"
        in proc.stdout
    )
    assert (
        "GUARD input 'x': expected dtype float32, got float64; pass a tensor of dtype float32"
        in proc.stdout
    )
    assert (
        "GUARD input 'x': expected 4 dimensions (2, 3, 32, 32), got 3 (2, 3, 32); pass a tensor "
        "of 4 dimensions [dynamo]" in proc.stdout
    )
    assert "GRAD grad mode: this is an inference artifact" in proc.stdout
    assert proc.stdout.strip().endswith("OK")


def test_nested_module_matches_eager_in_a_fresh_process(nested: dict, tmp_path: Path) -> None:
    gen = nested["root"] / "nested_gen.py"
    proc = _run(
        f"""
        import importlib.util, torch
        from tests.fixtures.models import build_nested_fn
        from torch_precompile import GuardError

        spec = importlib.util.spec_from_file_location("gen", {str(gen)!r})
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        fn, (x, y), kwargs = build_nested_fn()
        out = gen.forward(x, y, **kwargs)
        assert type(out) is dict and type(out["parts"]) is list and type(out["parts"][1]) is tuple
        torch.testing.assert_close(out, fn(x, y, **kwargs))
        with torch.no_grad():  # the module switches to the captured grad mode, as the artifact does
            torch.testing.assert_close(gen.forward(x, y, **kwargs), fn(x, y, **kwargs))
        x2, y2, b2 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
        want = fn(x2, y2, scale=2.0, bias=b2)
        torch.testing.assert_close(gen.forward(x2, y2, scale=2.0, bias=b2), want)
        for call in (gen.forward, gen.ARTIFACT):
            try:
                call(x, y, scale=3.0, bias=kwargs["bias"])
            except GuardError as exc:
                print("GUARD", exc)
            else:
                raise SystemExit("no GuardError")
        print("OK")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    guard_lines = [line for line in proc.stdout.splitlines() if line.startswith("GUARD")]
    assert len(guard_lines) == 2 and guard_lines[0] == guard_lines[1]
    assert (
        "input 'scale': expected 2.0, got 3.0; Python values are baked into the compiled code"
        in guard_lines[0]
    )


# --------------------------------------------------- output reconstruction


def test_fallback_to_dynamo_bytecode_still_matches(
    nested: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output the generator cannot write as code is rebuilt by Dynamo's bytecode, and says so."""
    monkeypatch.setattr(_output, "first_opaque", lambda tree: "forced")
    src = nested["artifact"].to_python(tmp_path / "fallback.py")
    assert "rebuilt by Dynamo's bytecode, not by plain code here: forced." in src
    assert "return PARTS.dynamo_fn(x, y, scale=scale, bias=bias)" in src
    assert "# graph_out = COMPILED_GRAPH(arg0, arg1, arg2)" in src
    gen = _import(tmp_path / "fallback.py", "fallback_gen")
    fn, args, kwargs = nested["fn"], nested["args"], nested["kwargs"]
    with torch.no_grad():
        torch.testing.assert_close(gen.forward(*args, **kwargs), fn(*args, **kwargs))
        with pytest.raises(GuardError, match="input 'y': expected shape"):
            gen.forward(args[0], torch.randn(5, 8), **kwargs)


def test_dataclass_output_is_rebuilt_with_its_class(tmp_path: Path) -> None:
    model, args, _ = build_dataclass_output()
    with torch.no_grad():
        artifact = Precompile.compile(model, args)
    Precompile.save(tmp_path / "dc.pt", artifact)
    src = artifact.to_python(tmp_path / "dc_gen.py")
    assert "\nimport tests.fixtures.models\n" in src
    assert "return tests.fixtures.models.MultiOutput(logits=graph_out[" in src
    gen = _import(tmp_path / "dc_gen.py", "dc_gen")
    x = torch.randn(3, 16)
    with torch.no_grad():
        out, ref = gen.forward(x), model(x)
    assert type(out) is MultiOutput
    torch.testing.assert_close(dataclasses.asdict(out), dataclasses.asdict(ref))


def test_training_module_backward_matches_eager(tmp_path: Path) -> None:
    """A training artifact's module: outputs carry grad_fn, gradients equal eager's."""
    model, (x,), _ = build_dropout_mlp()  # eval (dropout off), weights require grad
    artifact = Precompile.compile(model, (x,))
    assert artifact.training
    Precompile.save(tmp_path / "train.pt", artifact)
    src = artifact.to_python(tmp_path / "train_gen.py")
    assert (
        "if not torch.is_grad_enabled():\n        raise GuardError('grad mode: captured with" in src
    )
    gen = _import(tmp_path / "train_gen.py", "train_gen")
    out, ref = gen.forward(x), model(x)
    assert out.grad_fn is not None
    torch.testing.assert_close(out, ref)
    (out * ref.detach()).sum().backward()
    (ref * ref.detach()).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(gen.PARAMS[name].grad, p.grad)
    with torch.no_grad(), pytest.raises(GuardError, match="captured with grad enabled"):
        gen.forward(x)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    extras: dict


_Pair = collections.namedtuple("_Pair", ["a", "b"])


class _DictOut(collections.OrderedDict):
    pass


class _CustomInit(dict):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__(value=value)


def _rebuilt(value: object, outputs: list, flat_in: list) -> tuple[str | None, list[str], str]:
    """The recorded structure of ``value`` and the code the generator writes for it."""
    tree = _output_structure._encode(value, outputs, flat_in, 0)
    why = first_opaque(tree)
    if why is not None:
        return None, [], why
    imports: list[str] = []
    return _output._code(tree, imports), imports, ""


def test_output_structures_become_code() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    here = __name__
    code, imports, _ = _rebuilt(_Out(a, {"x": [b, None], "n": 3}), [a, b], [c])
    assert code == f"{here}._Out(logits=graph_out[0], extras={{'x': [graph_out[1], None], 'n': 3}})"
    assert f"import {here}" in imports
    assert _rebuilt(_Pair(c, (a,)), [a, b], [c])[0] == f"{here}._Pair(arg0, (graph_out[0],))"
    assert _rebuilt(_DictOut(y=b), [a, b], [c])[0] == f"{here}._DictOut({{'y': graph_out[1]}})"
    code, _, why = _rebuilt(torch.zeros(1), [a], [])
    assert code is None and why == "a returned tensor is neither a graph output nor a graph input"
    code, _, why = _rebuilt(_CustomInit(a), [a], [])
    assert code is None and "cannot be rebuilt" in why


def test_loaded_artifact_module_checks_the_guard_tree_in_plain_python(
    convnet: dict, tmp_path: Path
) -> None:
    """After a lean load the whole guard check is plain Python in the module: the typed
    guards' ifs, then PyTorch's guard tree (strides, aliasing, structure) as a function."""
    loaded = Precompile.load(convnet["root"] / "convnet.pt")
    src = loaded.to_python(tmp_path / "tree_gen.py")
    assert "\ndef _guard_tree(L, seen, T):\n" in src
    assert "ok = _guard_tree({'self': MODEL, 'x': x}, seen, T)" in src
    assert "PARTS.check_structure(" not in src
    gen = _import(tmp_path / "tree_gen.py", "tree_gen")
    (x,) = convnet["args"]
    with torch.no_grad():
        torch.testing.assert_close(gen.forward(x), loaded(x))
        # Same shape, dtype and device, other strides: only the tree can refuse it.
        strided = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        assert strided.shape == x.shape and strided.stride() != x.stride()
        with pytest.raises(GuardError, match=r"the guard tree \(strides"):
            gen.forward(strided)
