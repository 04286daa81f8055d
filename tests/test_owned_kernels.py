"""An artifact owns its compiled kernels from the moment Inductor returns them.

One fresh process compiles four kinds of artifact with ``TORCHINDUCTOR_CACHE_DIR``
(and Triton's cache) set to a directory of its own, removes that directory (a tmp
cleaner, a job that compiles in one step and saves in the next), then saves each.
Another fresh process, with no C++ compiler (``CC=/bin/false``, no ``gcc`` on
``PATH``) and an empty cache, loads each file and compares it with eager. Before
the artifact owned its kernels, save looked the shared objects (on CUDA, the
Triton cubins) up in the removed directory and wrote files that need a compiler
to load. On CPU and, where there is one, on a CUDA GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, no_compiler_env, run_script

KINDS = ("inference", "dynamic", "training", "generator")

# Compile all four, remove the cache directory, save; eager's results beside each file.
_BUILD = """
import json, logging, os, shutil, sys
import torch
from tests.fixtures.hf_models import tiny_decoder
from tests.fixtures.models import build_tiny_mlp
from torch_precompile import Precompile
from torch_precompile.generation import compile_generator

root, device = sys.argv[1], sys.argv[2]
warnings = []
handler = logging.Handler(level=logging.WARNING)
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("torch_precompile").addHandler(handler)

model, (x,), _ = build_tiny_mlp()
model, x, big = model.to(device), x.to(device), torch.randn(13, 64).to(device)
with torch.no_grad():
    inference = Precompile.compile(model, x)
    dynamic = Precompile.compile(model, x, dynamic=True)
    eager = {"inference": [model(x)], "dynamic": [model(x), model(big)]}
train_model = build_tiny_mlp()[0].train().to(device)
training = Precompile.compile(train_model, x)
train_model(x).sum().backward()
eager["training"] = [train_model(x).detach()] + [
    p.grad for _, p in sorted(train_model.named_parameters())
]
decoder = tiny_decoder("llama").to(device)
# One row (two programs): the point is the kernels the file owns, not batching.
generator = compile_generator(decoder, max_batch=1, max_length=12)
ids = torch.randint(3, 1000, (1, 5)).to(device)
with torch.no_grad():
    eager["generator"] = [
        decoder.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
    ]

shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"])  # the kernels are gone from disk
shutil.rmtree(os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
built = {"inference": inference, "dynamic": dynamic, "training": training,
         "generator": generator}
for kind, artifact in built.items():
    Precompile.save(os.path.join(root, kind + ".pt"), artifact)
torch.save({"x": x, "big": big, "ids": ids, "eager": eager}, os.path.join(root, "io.pt"))
print(json.dumps({"warnings": warnings}))
"""

# Load each file with no compiler and an empty cache; each kind's result or its error.
_LOAD = """
import json, os, sys
import torch
from torch_precompile import Precompile

root = sys.argv[1]
# fp32 on a GPU: fused kernels sum in another order than eager's.
tol = 1e-4 if sys.argv[2] == "cpu" else 1e-3
io = torch.load(os.path.join(root, "io.pt"))
x, big, ids, eager = io["x"], io["big"], io["ids"], io["eager"]

def run(kind, art):
    if kind == "inference":
        with torch.no_grad():
            return [art(x)]
    if kind == "dynamic":
        with torch.no_grad():
            return [art(x), art(big)]
    if kind == "training":
        out = art(x)
        out.sum().backward()
        return [out.detach()] + [p.grad for _, p in sorted(art.named_parameters())]
    return [art.generate(ids, torch.ones_like(ids), max_new_tokens=6, eos_token_id=None)]

results = {}
for kind in eager:
    try:
        got = run(kind, Precompile.load(os.path.join(root, kind + ".pt")))
        assert len(got) == len(eager[kind]), (len(got), len(eager[kind]))
        for g, w in zip(got, eager[kind]):
            if w.dtype.is_floating_point:
                torch.testing.assert_close(g, w, rtol=tol, atol=tol)
            else:
                assert torch.equal(g, w), (g, w)
        results[kind] = {"ok": True}
    except Exception as exc:
        results[kind] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
# Each loaded the lean way: the file's own kernels (and, on CUDA, its cubins), with no
# compiler or Dynamo in the process; a file that lacked them loads through PyTorch's.
results["compiler"] = [
    m for m in ("torch._dynamo", "torch._inductor.compile_fx") if sys.modules.get(m) is not None
]
# Through PyTorch's full path, the loaded artifact holds the file's kernels: saved
# again here (no compiler, nothing in the cache), the new file loads too.
# On CUDA, PyTorch's path needs a C compiler (Triton builds its launcher): the lean one.
if sys.argv[2] == "cpu":
    os.environ["TORCH_PRECOMPILE_LEAN"] = "0"
try:
    again = os.path.join(root, "dynamic-again.pt")
    Precompile.save(again, Precompile.load(os.path.join(root, "dynamic.pt")))
    got = run("dynamic", Precompile.load(again))
    for g, w in zip(got, eager["dynamic"]):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    results["saved again"] = {"ok": True}
except Exception as exc:
    results["saved again"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
print(json.dumps(results))
"""


def _last_json(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def loaded(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """Build and save in one fresh process (its cache directories removed before the
    saves), load in another with no compiler: each kind's result and the build's
    warnings."""
    device = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (Triton cubins kept from compile)")
    root = tmp_path_factory.mktemp(f"owned_kernels_{device}")
    build_cache = root / "build-cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        TORCHINDUCTOR_CACHE_DIR=str(build_cache),
        TRITON_CACHE_DIR=str(root / "build-triton-cache"),
    )
    # Four compiles (the generator several): a loaded machine needs more than the default.
    build = _last_json(run_script(_BUILD, str(root), device, env=env, timeout=1200).stdout)
    load_env = no_compiler_env(root)
    results = _last_json(run_script(_LOAD, str(root), device, env=load_env).stdout)
    return {"build_warnings": build["warnings"], "results": results, "root": root}


def test_save_after_the_cache_is_gone_warns_of_nothing(loaded: dict[str, Any]) -> None:
    assert not [w for w in loaded["build_warnings"] if "kernel" in w], loaded["build_warnings"]


@pytest.mark.parametrize("kind", KINDS)
def test_loads_without_compiler_equal_to_eager(loaded: dict[str, Any], kind: str) -> None:
    result = loaded["results"][kind]
    assert result["ok"], f"{kind}: {result.get('error')}"


def test_every_kind_loads_without_dynamo_or_the_compiler(loaded: dict[str, Any]) -> None:
    assert loaded["results"]["compiler"] == [], loaded["results"]["compiler"]


def test_a_loaded_artifact_saves_the_kernels_it_was_loaded_with(loaded: dict[str, Any]) -> None:
    result = loaded["results"]["saved again"]
    assert result["ok"], result.get("error")


@pytest.mark.parametrize("kind", KINDS)
def test_file_carries_shared_objects(loaded: dict[str, Any], kind: str) -> None:
    from torch_precompile import file as container

    _, sections = container.read_artifact(Path(loaded["root"]) / f"{kind}.pt")
    kernels = [data for name, data in sections.items() if name.startswith("kernel/")]
    assert kernels, f"{kind}: no kernel sections"
    assert all(bytes(data[:4]) == b"\x7fELF" for data in kernels)
