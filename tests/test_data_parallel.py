"""sharded data-parallel training from one compiled file (CPU, gloo).

FSDP2 cannot be captured (its hooks run under ``torch._dynamo.disable``; see
``tests/test_distributed.py``), so :func:`torch_precompile.shard_parameters`
shards a model as torchtitan's SimpleFSDP does: ``Shard(0)`` DTensor
parameters all-gathered inside the graph, gradients reduce-scattered. Real
torchrun jobs run once per module (``tests/fixtures/dp_job.py``), for 2 and 4
ranks: a *build* job where rank 0 alone compiles the training step of an MLP
(through the staged pipeline) and of a Hugging Face Llama and every rank
saves its shard, then a fresh
*load* job (empty Inductor cache, ``CXX=/bin/false``) where every rank loads
the files and trains 3 SGD steps on its own batch beside the same sharded
model trained eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import rank_results, torchrun

WORLDS = (2, 4)
MODELS = ("mlp", "llama")
TOL = {"mlp": 1e-7, "mlp_bound": 1e-7, "llama": 1e-5}  # losses, gradient shards, weights

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build, then load and train in a fresh job, for 2 and 4 ranks."""
    base = tmp_path_factory.mktemp("dp")
    results: dict[str, Any] = {}
    for world in WORLDS:
        out = base / f"world{world}"
        out.mkdir()
        torchrun("dp_job", world, "build", str(out))
        cache = base / f"inductor-cache-{world}"
        cache.mkdir()
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "CXX": "/bin/false"}
        torchrun("dp_job", world, "load", str(out), env=env)
        results[world] = {
            "dir": out,
            "build": rank_results(out, "build", world),
            "load": rank_results(out, "load", world),
            "cache": sorted(p.name for p in cache.rglob("*") if p.is_file()),
        }
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_compiled_once_saved_once(jobs: dict[str, Any], world: int) -> None:
    build = jobs[world]["build"]
    assert set(build[0]["compile_s"]) == set(MODELS)
    assert all(not r["compile_s"] for r in build[1:]), "only rank 0 compiles"
    names = sorted(p.name for p in jobs[world]["dir"].iterdir() if not p.name.endswith(".lock"))
    for model in MODELS:
        assert f"{model}.pt" in names
        shards = [n for n in names if n.startswith(f"{model}.pt.rank")]
        assert shards == [f"{model}.pt.rank{r}-of-{world}" for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_joint_graph_gathers_and_reduce_scatters(jobs: dict[str, Any], world: int) -> None:
    # The MLP's 4 parameters: each all-gathered in the forward and its gradient
    # reduce-scattered in the backward, inside the one compiled graph; no all-reduce.
    assert jobs[world]["build"][0]["collectives"] == {
        "all_gather_into_tensor": 4,
        "reduce_scatter_tensor": 4,
        "wait_tensor": 8,
    }


@pytest.mark.parametrize("world", WORLDS)
def test_fresh_job_reads_own_shard_and_compiles_nothing(jobs: dict[str, Any], world: int) -> None:
    for rank, res in enumerate(jobs[world]["load"]):
        expected = [f"{m}.pt" for m in MODELS] + [f"{m}.pt.rank{rank}-of-{world}" for m in MODELS]
        assert res["files_read"] == sorted(expected)
        assert not res["compiler_imported"]
    assert not [n for n in jobs[world]["cache"] if n.endswith(".so")]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["mlp", "mlp_bound", "llama"])
def test_three_steps_match_eager(jobs: dict[str, Any], world: int, case: str) -> None:
    tol = TOL[case]
    losses = []
    for res in jobs[world]["load"]:
        train = res[case]
        assert len(train["loss"]) == 3
        for got, want in zip(train["loss"], train["loss_eager"], strict=True):
            assert abs(got - want) <= tol * max(1.0, abs(want))
        assert max(train["grad_diff"]) <= tol  # this rank's gradient shards, every step
        assert train["param_diff"] <= tol  # the shards after 3 optimizer steps
        assert train["grads_sharded"]  # reduce-scattered: Shard(0), a 1/world slice
        assert train["loss"][-1] < train["loss"][0]  # it trains
        losses.append(train["loss"][0])
    assert len(set(losses)) == world  # every rank trained on its own batch


@pytest.mark.parametrize("world", WORLDS)
def test_training_artifacts_load_lean(jobs: dict[str, Any], world: int) -> None:
    # The sharded steps run forward and backward on the lean path (the
    # Shard(0) DTensor parameters flattened to their local shards inside the lean
    # autograd.Function, the reduce-scattered gradients rebuilt as DTensors), and
    # the lean guards decide every call.
    for res in jobs[world]["load"]:
        assert res["lean"] == {"mlp": True, "llama": True, "mlp_bound": True}
        assert res["dynamo_guards_built"] == []


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_are_averaged_over_ranks(jobs: dict[str, Any], world: int) -> None:
    # The loaded artifact's gradient, gathered, equals a plain model's gradient
    # averaged over every rank's batch: the reduce-scatter is in the graph.
    for res in jobs[world]["load"]:
        assert res["mlp_reference_grad_diff"] <= 1e-7


@pytest.mark.parametrize("world", WORLDS)
def test_uneven_first_dimension_is_refused(jobs: dict[str, Any], world: int) -> None:
    for res in jobs[world]["load"]:
        message = res["uneven_error"]
        assert message is not None, "a 5-row weight over an even world must be refused"
        assert f"parameter 'weight' of shape [5, 8] cannot be split evenly over {world}" in message
        assert "every rank's shard must have the same shape" in message


@pytest.mark.parametrize("world", WORLDS)
def test_unsharded_model_is_a_typed_error(jobs: dict[str, Any], world: int) -> None:
    # load(path, model=the plain model): the artifact's parameter names and
    # placements are checked before anything runs.
    for res in jobs[world]["load"]:
        message = res["plain_model_error"]
        assert message is not None, "binding an unsharded model must fail"
        assert "model= tensor 'down.parametrizations.bias.original'" in message
        assert f"['Shard(0)'] on mesh cpu [{world}]" in message
        assert "this job has no tensor of that name" in message
        assert "shard_parameters" in message
