"""Shared fixtures: each compiled artifact is built once per session."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.models import build_transformer  # noqa: E402
from torch_precompile import Precompile  # noqa: E402


@dataclasses.dataclass
class Staged:
    """Every stage's output for one inference capture of the reference transformer."""

    model: torch.nn.Module
    example: torch.Tensor
    expected: torch.Tensor
    dynamo: Any
    aot: Any
    inductor: Any
    artifact: Any
    path: Path


@pytest.fixture(scope="session")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Staged:
    model, (ids,), _ = build_transformer()
    with torch.no_grad():
        expected = model(ids)
        d = Precompile.dynamo(model, ids)
        a = Precompile.aot_autograd(d)
        i = Precompile.inductor(a)
        art = Precompile.precompile(i)
    path = tmp_path_factory.mktemp("staged") / "transformer.pt"
    Precompile.save(path, art, d.bytecode, i.guards)
    return Staged(model, ids, expected, d, a, i, art, path)


def run_script(
    source: str, *args: str, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a fresh interpreter with the repo importable; fail loudly on error.

    ``env`` replaces the environment (it must make the repo importable itself,
    as :func:`no_compiler_env` does).
    """
    env = env if env is not None else dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"fresh process failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def no_compiler_env(root: Path) -> dict[str, str]:
    """An environment in which no C++ compiler can run.

    ``CC``/``CXX`` point at ``/bin/false``, ``PATH`` holds only ``python`` (so no
    ``gcc``/``g++``/``cc``/``c++`` can be found) and ``TORCHINDUCTOR_CACHE_DIR``
    is a fresh empty directory under ``root``.
    """
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "python"
    if not link.exists():
        link.symlink_to(sys.executable)
    cache = root / "inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.pop("TORCH_PRECOMPILE_SHIPPED_KERNELS", None)
    env.pop("TORCH_PRECOMPILE_FAST_LOAD", None)
    env.update(
        PATH=str(bin_dir),
        CC="/bin/false",
        CXX="/bin/false",
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        TRITON_CACHE_DIR=str(root / "triton-cache"),
        PYTHONPATH=str(ROOT),
    )
    for tool in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    return env
