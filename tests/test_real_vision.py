"""torchvision and timm models through the staged flow, saved and loaded fresh.

torchvision has no wheel for torch 2.13's CPU build (the one on PyPI is a CUDA
build whose operators do not load beside it), and timm imports torchvision:
the test extra cannot install them here, so this module runs where they are
installed (the GPU machine, on its CPU and its GPU) and is skipped elsewhere.
Hugging Face's own ResNet, ConvNeXt and ViT run everywhere
(``test_real_transformers.py``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fresh_load_results, no_compiler_env

from torch_precompile import Precompile

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installable here")
timm = pytest.importorskip("timm", reason="timm needs torchvision")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _vit() -> torch.nn.Module:
    # torchvision's VisionTransformer keeps functools.partial(nn.LayerNorm, eps=1e-6).
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )


MODELS = {
    "torchvision_resnet18": (
        "torchvision",
        functools.partial(torchvision.models.resnet18, num_classes=10),
    ),
    "torchvision_vit": ("torchvision", _vit),
    "timm_convnext": (
        "timm",
        functools.partial(timm.create_model, "convnext_atto", pretrained=False, num_classes=10),
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("vision")
    cases = {}
    for device in DEVICES:
        for name, (_, build) in MODELS.items():
            torch.manual_seed(0)
            model = build().eval().to(device)
            images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
            args = (images.to(device),)
            with torch.no_grad():
                want = model(*args)
                gm, bytecode, guards = Precompile.dynamo(model, args)
                joint, guards = Precompile.aot_autograd(gm, guards)
                compiled, guards = Precompile.inductor(joint, guards)
                artifact = Precompile.precompile(compiled)
            key = f"{name}[{device}]"
            path = out / f"{key}.pt2"
            Precompile.save(path, artifact, bytecode, guards)
            ref = out / f"{key}.ref"
            torch.save([(args, {}, want)], ref)
            cases[key] = {"path": str(path), "ref": str(ref)}
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_fresh_process_load_matches_eager(
    built: dict[str, Any], name: str, device: str, tmp_path: Path
) -> None:
    library = MODELS[name][0]
    key = f"{name}[{device}]"
    # CPU artifacts ship their C++ kernels: no compiler at load. On CUDA, Triton
    # still builds its small C launcher helper once per machine, so the usual
    # environment stays.
    env = no_compiler_env(tmp_path)
    if device == "cuda":
        env = dict(os.environ, PYTHONPATH=env["PYTHONPATH"])
    # cuDNN convolves float32 with TF32 by default, and the loaded process may pick
    # another algorithm than the building one: 1e-3 is TF32's resolution (10 bits).
    tol = {"rtol": 1e-3, "atol": 1e-3} if device == "cuda" else {}
    results = fresh_load_results({key: built[key]}, library, env, **tol)
    assert results[key]["ok"], results[key]["error"]
