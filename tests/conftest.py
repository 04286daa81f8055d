"""Shared fixtures: each compiled artifact is built once per session."""

from __future__ import annotations

import dataclasses
import os
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


def run_script(source: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a fresh interpreter with the repo importable; fail loudly on error."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
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
