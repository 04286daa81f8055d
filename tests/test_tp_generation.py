"""A tensor-parallel generator: one code file for both ranks, tokens as the unsharded model's.

``tests/fixtures/tp_models.py``'s Llama (random-init, 2 layers, grouped-query
attention, float32) parallelised over 2 gloo ranks (``q/k/v``, ``gate/up``
column-wise; ``o``, ``down`` row-wise). Rank 0 builds its generator
(``compile_generator``) in a *build* job; a fresh *load* job, where
transformers cannot be imported, loads it on both ranks and generates greedily
(``tests/fixtures/tp_gen_job.py``). The tokens are compared with transformers'
``generate`` on the same model unsharded, exactly, and each step's logits within 1e-4.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from conftest import rank_results, torchrun

pytest.importorskip("transformers")

WORLD = 2

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("tpgen")
    out = base / "files"
    out.mkdir()
    torchrun("tp_gen_job", WORLD, "build", str(out))
    cache = base / "inductor-cache"
    cache.mkdir()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "CXX": "/bin/false"}
    torchrun("tp_gen_job", WORLD, "load", str(out), env=env)
    return {
        "dir": out,
        "build": rank_results(out, "build", WORLD),
        "load": rank_results(out, "load", WORLD),
        "reference": json.loads((out / "reference.json").read_text()),
    }


def test_one_code_file_and_a_shard_per_rank(job: dict[str, Any]) -> None:
    names = sorted(p.name for p in job["dir"].iterdir() if p.name.startswith("gen.pt"))
    names = [n for n in names if not n.endswith(".lock")]
    assert names == ["gen.pt"] + [f"gen.pt.rank{r}-of-{WORLD}" for r in range(WORLD)]
    for rank, res in enumerate(job["load"]):
        assert res["files_read"] == ["gen.pt", f"gen.pt.rank{rank}-of-{WORLD}"]


@pytest.mark.parametrize("batch", ["batch2", "batch1"])
def test_greedy_tokens_equal_unsharded_generate(job: dict[str, Any], batch: str) -> None:
    want = job["reference"][batch]
    assert len(want[0]) > 6  # new tokens were generated
    for res in job["load"]:
        assert res[batch] == want  # every rank, every row, every token


@pytest.mark.parametrize("batch", ["batch2", "batch1"])
def test_logits_equal_unsharded_generate(job: dict[str, Any], batch: str) -> None:
    """Each step's raw logits on every rank within 1e-4 (and fp32's relative 1e-5) of
    the unsharded model's (``output_logits``): what sampling draws from, not only its
    argmax."""
    want = torch.tensor(job["reference"][batch + " logits"])
    for rank, res in enumerate(job["load"]):
        got = torch.tensor(res[batch + " logits"])
        assert got.shape == want.shape, f"rank {rank}: {tuple(got.shape)}"
        diff = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (
            f"rank {rank}: logits differ from the unsharded model's by {diff}"
        )


def test_cache_holds_this_ranks_heads(job: dict[str, Any]) -> None:
    heads = job["build"][0]["heads"]
    assert {h for h, _ in job["build"][0]["kv_shapes"]} == {heads // WORLD}
    for res in job["load"]:
        assert res["cache_heads"] == [heads // WORLD]


def test_served_lean_without_transformers(job: dict[str, Any]) -> None:
    """Nor Dynamo: the shards' DTensors and parameters are made without the calls that
    import it on first use (``from_local``, ``DTensor(...)``, ``detach``), and the
    step's bytecode reads a hook dict's key without ``torch._dynamo.utils``."""
    for res in job["load"]:
        assert res["lean"]
        assert not res["transformers_imported"]
        assert not res["compiler_imported"]
        assert not res["dynamo_imported"]
