"""Training on a 2-D (data x tensor parallel) mesh from one compiled file (CPU, gloo).

4 ranks, a (2 x 2) mesh ``("dp", "tp")``: ``tests/fixtures/tp_models.py``'s MLP and
transformer block parallelised over ``mesh["tp"]`` (``parallelize_module``) and
replicated over ``dp`` (:func:`torch_precompile.replicate_parameters`:
gradients averaged over ``dp`` by an all-reduce in the compiled backward).
Real torchrun jobs (``tests/fixtures/mesh2d_job.py``): a *build* job where rank 0
alone compiles each training step and every rank saves its shard, then a
fresh *load* job (empty Inductor cache, ``CXX=/bin/false``) where every rank
loads the files and runs one training step (forward, backward, SGD) on its
``dp`` group's batch beside the same model run eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import rank_results, torchrun

from torch_precompile._compat.distributed import submeshes_at_run_time

WORLD = 4
MODELS = ("mlp", "block")
# Losses (relative), gradient shards and weights after the SGD step: Inductor's
# float32 rounding, measured at most 2.8e-9 (gradients) and 7.5e-9 (weights).
TOL = 1e-7

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("mesh2d")
    out = base / "files"
    out.mkdir()
    torchrun("mesh2d_job", WORLD, "build", str(out))
    return base, out, rank_results(out, "build", WORLD)


def test_refused_at_save_only_where_torch_cannot_run_it(built: Any) -> None:
    """torch 2.11 traces the ``tp`` submesh's group as the compiling rank's, which the
    other ``dp`` group lacks: saving is a ValueError there, on every rank."""
    refusals = [r["refused"] for r in built[2]]
    if submeshes_at_run_time():
        assert refusals == [{}] * WORLD
        return
    for refused in refusals:
        assert set(refused) == set(MODELS), refused
        assert all("use torch 2.13 or later" in text for text in refused.values()), refused


@pytest.fixture(scope="module")
def job(built: Any) -> dict[str, Any]:
    base, out, build = built
    if not submeshes_at_run_time():
        pytest.skip(
            f"torch {torch.__version__} cannot run a 2-D mesh's graph on every rank: refused "
            "at save (test_refused_at_save_only_where_torch_cannot_run_it)"
        )
    cache = base / "inductor-cache"
    cache.mkdir()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "CXX": "/bin/false"}
    torchrun("mesh2d_job", WORLD, "load", str(out), env=env)
    return {
        "dir": out,
        "build": build,
        "load": rank_results(out, "load", WORLD),
        "cache": sorted(p.name for p in cache.rglob("*") if p.is_file()),
    }


def test_compiled_once_one_file_per_rank(job: dict[str, Any]) -> None:
    build = job["build"]
    assert set(build[0]["compile_s"]) == set(MODELS)
    assert all(not r["compile_s"] for r in build[1:]), "only rank 0 compiles"
    names = sorted(p.name for p in job["dir"].iterdir() if ".pt" in p.name)
    names = [n for n in names if not n.endswith(".lock")]
    for model in MODELS:
        assert f"{model}.pt" in names
        shards = [n for n in names if n.startswith(f"{model}.pt.rank")]
        assert shards == [f"{model}.pt.rank{r}-of-{WORLD}" for r in range(WORLD)]


def test_fresh_job_reads_own_shard_compiles_nothing(job: dict[str, Any]) -> None:
    for rank, res in enumerate(job["load"]):
        expected = [f"{m}.pt" for m in MODELS] + [f"{m}.pt.rank{rank}-of-{WORLD}" for m in MODELS]
        assert res["files_read"] == sorted(expected)
        assert not res["compiler_imported"]
        assert res["lean"] == {"mlp": True, "block": True, "mlp_bound": True}
        assert res["dynamo_guards_built"] == []
    assert not [n for n in job["cache"] if n.endswith(".so")]


@pytest.mark.parametrize("case", ["mlp", "block", "mlp_bound"])
def test_training_step_matches_eager(job: dict[str, Any], case: str) -> None:
    losses = []
    for res in job["load"]:
        step = res[case]
        want = step["loss_eager"]
        assert abs(step["loss"] - want) <= TOL * max(1.0, abs(want))
        assert step["grad_diff"] <= TOL  # this rank's gradient shard of every parameter
        assert step["param_diff"] <= TOL  # after the SGD step
        # Gradients on the 2-D mesh: replicated over dp, the TP placement over tp.
        assert step["grad_meshes"] == ["(2, 2)"]
        assert step["grad_placements"] == ["R R", "R S(0)", "R S(1)"]
        losses.append(step["loss"])
    # Ranks of one dp group share a batch (and a loss); the two dp groups differ.
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]


@pytest.mark.parametrize("name", MODELS)
def test_gradients_are_the_data_parallel_mean(job: dict[str, Any], name: str) -> None:
    # Gathered over tp, each rank's gradient equals a plain (unparallelised)
    # model's gradient averaged over both dp groups' batches.
    for res in job["load"]:
        assert res[f"{name}_reference_grad_diff"] <= TOL


def test_other_mesh_shape_is_a_typed_error(job: dict[str, Any]) -> None:
    for res in job["load"]:
        bound = res["mesh_1x4_error"]
        assert bound is not None, "a model on a (1 x 4) mesh must be refused"
        assert "saved for mesh cpu [2, 2], dims ['dp', 'tp']" in bound
        assert "this job has mesh cpu [1, 4], dims ['dp', 'tp']" in bound
        flat = res["mesh_flat_error"]
        assert flat is not None, "a flat 4-rank mesh must be refused"
        assert "saved for mesh cpu [2, 2], dims ['dp', 'tp']" in flat
        assert "this job has mesh cpu [4], dims ['tp'] (mesh=)" in flat
