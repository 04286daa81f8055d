"""The beautiful.py flow end to end, saved here and loaded in a fresh process.

Covers the transformer, a conv net with BatchNorm (eval), a function with
keyword arguments and a nested dict/list output, a model returning a
dataclass, a closure, and Python scalar arguments.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, run_script

from tests.fixtures import models
from torch_precompile import Precompile

CASES = ["convnet", "nested_fn", "dataclass_output", "closure", "scalar_fn"]


def staged_flow(model, args, kwargs):
    gm, bytecode, guards = Precompile.dynamo(model, args, kwargs)
    joint_gm, guards = Precompile.aot_autograd(gm, guards)
    compiled_joint_gm, guards = Precompile.inductor(joint_gm, guards)
    return Precompile.precompile(compiled_joint_gm), bytecode, guards


@pytest.fixture(scope="module")
def saved(staged, tmp_path_factory):
    """Each case compiled once, saved with its inputs and eager's outputs."""
    root = tmp_path_factory.mktemp("e2e")
    manifest = {"transformer": [str(staged.path), str(root / "transformer.io")]}
    torch.save(((staged.example,), {}, staged.expected), root / "transformer.io")
    in_process = {}
    for name in CASES:
        model, args, kwargs = models.BUILDERS[name]()
        with torch.no_grad():
            expected = model(*args, **kwargs)
            artifact, bytecode, guards = staged_flow(model, args, kwargs)
            in_process[name] = (artifact(*args, **kwargs), expected)
        Precompile.save(root / f"{name}.pt", artifact, bytecode, guards)
        torch.save((args, kwargs, expected), root / f"{name}.io")
        manifest[name] = [str(root / f"{name}.pt"), str(root / f"{name}.io")]
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, in_process


def _leaves(value):
    if hasattr(value, "__dataclass_fields__"):
        return _leaves([getattr(value, f) for f in value.__dataclass_fields__])
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _leaves(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    return [value]


@pytest.mark.parametrize("name", CASES)
def test_in_process_artifact_matches_eager(saved, name) -> None:
    got, expected = saved[1][name]
    assert type(got) is type(expected)
    for g, e in zip(_leaves(got), _leaves(expected), strict=True):
        torch.testing.assert_close(g, e)


FRESH = """
import json, sys
import torch
from torch_precompile import Precompile

manifest = json.load(open(sys.argv[1]))

def leaves(value):
    if hasattr(value, "__dataclass_fields__"):
        return leaves([getattr(value, f) for f in value.__dataclass_fields__])
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in leaves(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in leaves(v)]
    return [value]

report = {}
# Module models first: their classes must not be needed to load and run them.
first = ["transformer", "convnet"]
for name in first + [n for n in manifest if n not in first]:
    path, io_path = manifest[name]
    loaded = Precompile.load(path)
    if name in ("transformer", "convnet"):
        assert "tests.fixtures.models" not in sys.modules, f"loading {name} imported its code"
    args, kwargs, expected = torch.load(io_path, weights_only=False)
    with torch.no_grad():
        got = loaded(*args, **kwargs)
    assert type(got) is type(expected), (name, type(got), type(expected))
    pairs = list(zip(leaves(got), leaves(expected), strict=True))
    for g, e in pairs:
        torch.testing.assert_close(g, e)
    report[name] = {"type": type(got).__name__, "leaves": len(pairs),
                    "max_diff": max(float((g - e).abs().max()) for g, e in pairs)}
print(json.dumps(report))
"""


def test_every_case_loads_and_matches_eager_in_a_fresh_process(saved) -> None:
    root, _ = saved
    proc = run_script(FRESH, str(root / "manifest.json"))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"transformer", *CASES}
    assert report["dataclass_output"]["type"] == "MultiOutput"
    assert report["nested_fn"]["type"] == "dict" and report["nested_fn"]["leaves"] == 4
    assert all(r["max_diff"] < 1e-4 for r in report.values()), report


def test_beautiful_py_runs_and_matches(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "beautiful.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "beautiful.py: max |loaded - eager|" in proc.stdout and "(OK)" in proc.stdout
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile", "save", "load"):
        assert f"[beautiful] {stage}:" in proc.stdout
