"""Models of libraries beyond transformers: diffusers and sentence-transformers.

Each model is tiny and random-init (nothing is downloaded), compiled once per
module, saved, and loaded in one fresh process per library, standalone and
with ``model=`` a rebuilt model (the builders seed torch), on the lean path
and on PyPI torch's full path; outputs are compared with eager's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_script

from torch_precompile import Precompile
from torch_precompile._compat import BEFORE_2_13

pytest.importorskip("diffusers", reason="the test extra installs diffusers")
pytest.importorskip("sentence_transformers", reason="the test extra installs sentence-transformers")
from tests.fixtures.library_models import (
    SENTENCE_BATCHES,
    diffusers_model,
    sentence_transformer,
)

DIFFUSERS = ("unet", "unet_cond", "vae_decoder")


def _sample(out: Any) -> torch.Tensor:
    return out.sample if hasattr(out, "sample") else out


@pytest.fixture(scope="module")
def diffusers_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("diffusers")
    cases = {}
    for name in DIFFUSERS:
        model, args = diffusers_model(name)
        with torch.no_grad():
            want = _sample(model(*args))
            artifact = Precompile.compile(model, args)
            torch.testing.assert_close(_sample(artifact(*args)), want)
        path, ref = root / f"{name}.pt", root / f"{name}.ref"
        Precompile.save(path, artifact)
        torch.save((args, want), ref)
        cases[name] = {"path": str(path), "ref": str(ref)}
    return cases


_DIFFUSERS_LOAD = """
import json, os, sys
import torch
from tests.fixtures.library_models import diffusers_model
from torch_precompile import Precompile

results = {}
for name, case in json.loads(sys.argv[1]).items():
    args, want = torch.load(case["ref"], weights_only=False)
    for fast in ("1", "0"):
        os.environ["TORCH_PRECOMPILE_LEAN"] = fast
        for how in ("standalone", "model"):
            key = f"{name} {how} fast={fast}"
            try:
                model = diffusers_model(name)[0] if how == "model" else None
                art = Precompile.load(case["path"], model=model)
                with torch.no_grad():
                    for _ in range(2):
                        got = art(*args)
                        got = got.sample if hasattr(got, "sample") else got
                        diff = (got - want).abs().max().item()
                results[key] = {"ok": diff < 1e-4, "diff": diff}
            except Exception as exc:
                results[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
print(json.dumps(results))
"""


def test_diffusers_fresh_loads_match_eager(diffusers_files: dict[str, dict[str, str]]) -> None:
    """UNet2DModel (a FrozenDict config, a class-level ``_keep_in_fp32_modules`` read
    through hasattr), UNet2DConditionModel and an AutoencoderKL decoder load
    standalone and with ``model=``, fast and full path, and equal eager."""
    proc = run_script(_DIFFUSERS_LOAD, json.dumps(diffusers_files))
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4 * len(DIFFUSERS)
    failed = {k: v for k, v in results.items() if not v["ok"]}
    assert not failed, failed


@pytest.fixture(scope="module")
def encoder_file(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from torch_precompile.encoding import compile_for_encode

    root = tmp_path_factory.mktemp("sentence")
    model = sentence_transformer(str(root / "model"))
    artifact = compile_for_encode(model, ["the cat sat", "a dog"])
    path = root / "encoder.pt"
    Precompile.save(path, artifact)
    refs = [model.encode(batch, convert_to_tensor=True) for batch in SENTENCE_BATCHES]
    torch.save(refs, root / "encoder.ref")
    return {"dir": str(root / "model"), "path": str(path), "ref": str(root / "encoder.ref")}


_ENCODE_LOAD = """
import json, sys
import torch
from tests.fixtures.library_models import SENTENCE_BATCHES, sentence_transformer
from torch_precompile import Precompile
from torch_precompile.encoding import encode_with

case = json.loads(sys.argv[1])
model = sentence_transformer(case["dir"] + "-again")
refs = torch.load(case["ref"], weights_only=False)
results = {}
for how in ("standalone", "model"):
    art = Precompile.load(case["path"], model=model if how == "model" else None)
    diffs = []
    with encode_with(model, art):
        for batch, want in zip(SENTENCE_BATCHES, refs):
            diffs.append((model.encode(batch, convert_to_tensor=True) - want).abs().max().item())
            with torch.no_grad():
                got = model.encode(batch, convert_to_tensor=True)
            diffs.append((got - want).abs().max().item())
        features = model.tokenize(SENTENCE_BATCHES[0])
        with torch.no_grad():  # the same dict twice: forward wrote into it the first time
            for _ in range(2):
                got = model(features)["sentence_embedding"]
                diffs.append((got - refs[0]).abs().max().item())
    eager = (model.encode(SENTENCE_BATCHES[0], convert_to_tensor=True) - refs[0]).abs().max()
    results[how] = {"diffs": diffs, "eager_back": eager.item()}
print(json.dumps(results))
"""


def test_sentence_transformer_encode_on_artifact(encoder_file: dict[str, str]) -> None:
    """``encode`` through :func:`encode_with` returns eager's embeddings for batches of
    1 to 6 sentences and padded lengths 3 to 30, under inference_mode (encode's
    own) and no_grad, standalone and with ``model=``; the same features dict is
    served twice; the model's own forward is back after the block."""
    proc = run_script(_ENCODE_LOAD, json.dumps(encoder_file))
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for how in ("standalone", "model"):
        diffs = results[how]["diffs"]
        assert len(diffs) == 2 * len(SENTENCE_BATCHES) + 2
        assert max(diffs) < 1e-5, (how, diffs)
        assert results[how]["eager_back"] < 1e-6


def test_encode_artifact_is_one_dynamic_variant(encoder_file: dict[str, str]) -> None:
    """One capture serves every batch and length: the inputs are dynamic in both
    dimensions (the mask shares the ids' sizes) and batch 1 is in the range. On
    torch 2.11 scaled_dot_product_attention's own check leaves batch 1 out (a shape
    guard ``Ne(batch, 1)``): a second variant, for one sentence, is bundled."""
    loaded = Precompile.load(encoder_file["path"])
    first = loaded.variants[0] if loaded.variants else loaded
    text = "\n".join(str(g) for g in first.guards)
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert f"input['{key}']': int64 (s" in text, text
    assert "dimension 0 (s" in text and "in [0, inf]" in text, text
    if not BEFORE_2_13:
        assert not loaded.variants
    else:
        assert len(loaded.variants) == 2, loaded
        assert "Ne(input 'input['input_ids']'.shape[0], 1)" in text, text
    # Under 5 MiB a variant (each carries its compiled code; the weights are shared).
    assert Path(encoder_file["path"]).stat().st_size < 5 * 2**20 * max(1, len(loaded.variants))
