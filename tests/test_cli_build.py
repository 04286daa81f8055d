"""``torch-precompile build DIR -o OUT``: a model saved with ``save_pretrained`` into one file.

Tiny random-init GPT-2 and BERT (nothing downloaded) are saved to a directory,
built by the command in a subprocess (GPT-2 with named inputs and a task,
BERT with the config's default inputs and a dynamic sequence length), and loaded in a
fresh process whose outputs are compared with eager ``from_pretrained``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_script

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch_precompile", "build", *args],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    import torch

    root = tmp_path_factory.mktemp("cli_build")
    torch.manual_seed(0)
    small = dict(vocab_size=100, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, **small)
    ).save_pretrained(root / "gpt2")
    transformers.BertModel(
        transformers.BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=64,
            vocab_size=100,
        )
    ).save_pretrained(root / "bert")
    cases = {
        "gpt2": ("--task", "causal-lm", "--input", "input_ids:int64:2x16"),
        "bert": ("--dynamic", "input_ids:1:2:32"),
    }
    out = {}
    for name, options in cases.items():
        path = root / f"{name}.pt"
        proc = _command(str(root / name), "-o", str(path), *options)
        assert proc.returncode == 0, proc.stderr[-5000:]
        out[name] = {"dir": str(root / name), "path": str(path), "stderr": proc.stderr}
    return out


def test_build_prints_each_stage_and_its_time(built: dict[str, dict[str, str]]) -> None:
    for name, case in built.items():
        log = case["stderr"]
        for line in (
            "torch-precompile build: loading ",
            "torch_precompile: dynamo: done in ",
            "torch_precompile: aot_autograd: done in ",
            "torch_precompile: inductor: done in ",
            "torch_precompile: precompile: done in ",
            "torch-precompile build: saving ",
            f"torch-precompile build: wrote {case['path']} (",
        ):
            assert line in log, f"{name}: {line!r} not in\n{log}"
        assert log.index("loading") < log.index("dynamo: done") < log.index("wrote"), log
    assert "GPT2LMHeadModel" in built["gpt2"]["stderr"]
    assert "input_ids (2, 16) torch.int64" in built["bert"]["stderr"]  # the config's default
    assert "compiling the variant for size 1" in built["bert"]["stderr"]


_LOAD = """
import json, sys
import torch
import transformers
from torch_precompile import Precompile

cases = json.loads(sys.argv[1])
results = {}
for name, case, cls, shapes in (
    ("gpt2", cases["gpt2"], transformers.AutoModelForCausalLM, [(2, 16)]),
    ("bert", cases["bert"], transformers.AutoModel, [(2, 16), (2, 9), (2, 32), (2, 1)]),
):
    artifact = Precompile.load(case["path"])
    eager = cls.from_pretrained(case["dir"]).eval()
    for shape in shapes:
        ids = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want, got = eager(input_ids=ids)[0], artifact(input_ids=ids)[0]
        results[f"{name} {shape}"] = [list(got.shape), (got - want).abs().max().item()]
print(json.dumps(results))
"""


def test_built_files_load_fresh_and_match_eager(built: dict[str, dict[str, str]]) -> None:
    proc = run_script(_LOAD, json.dumps(built))
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 5, results
    for key, (shape, diff) in results.items():
        assert diff < 1e-4, (key, shape, diff)
    assert results["gpt2 (2, 16)"][0] == [2, 16, 100]  # logits: AutoModelForCausalLM
    assert results["bert (2, 9)"][0] == [2, 9, 32]


def test_build_refuses_a_directory_without_a_saved_model(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    proc = _command(str(tmp_path), "-o", str(tmp_path / "out.pt"))
    assert proc.returncode == 1
    assert "ModelDirectoryError" not in proc.stderr  # one line, no traceback
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("torch-precompile: error: "), proc.stderr
    assert "holds no saved model: there is no config.json (found: weights.bin)" in line
    assert "save_pretrained" in line
    assert not (tmp_path / "out.pt").exists()
    missing = _command(str(tmp_path / "nowhere"), "-o", str(tmp_path / "out.pt"))
    assert missing.returncode == 1
    assert "is not a directory" in missing.stderr
