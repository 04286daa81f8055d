"""One artifact for every rank of a torchrun job (CPU, gloo, 2 and 4 ranks).

Five real torchrun jobs run once per module (``tests/fixtures/dist_job.py``): for
each world size a *build* job, where rank 0 alone compiles a tensor-parallel
MLP, an MLP whose ranks each cut their own slice of a replicated activation
(an offset that depends on the rank), a transformer block, a Hugging Face
Llama (inference) and the MLP's and the Llama's training steps, and every
rank saves its shard; then a fresh *load* job with an empty Inductor cache and
no C++ compiler (``CXX=/bin/false``) that loads the files, runs them and
compares each rank's output, loss and gradients with the same parallelised
model run eagerly. The 4-rank load job also loads the 2-rank files. A 2-rank
*orders* job builds its own models around standalone loads.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import rank_results, torchrun

from torch_precompile import DistributedLayoutError, IncompatibleSystemError, PrecompileError

ROOT = Path(__file__).resolve().parent.parent
WORLDS = (2, 4)
TOL = 1e-5
# "slice": each rank cuts a rank-dependent slice; "dtout": the MLP returning a DTensor;
# "llama": a Hugging Face LlamaForCausalLM
MODELS = ("mlp", "slice", "dtout", "block", "llama", "train", "llama_train")
TRAIN_TOL = {"train": 1e-6, "llama_train": 1e-5}  # loss and gradients vs eager

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build and then load in fresh jobs, for 2 and 4 ranks; every rank's results."""
    base = tmp_path_factory.mktemp("dist")
    dirs = {w: base / f"world{w}" for w in WORLDS}
    results: dict[str, Any] = {"dirs": dirs}
    for world in WORLDS:
        dirs[world].mkdir()
        torchrun("dist_job", world, "build", str(dirs[world]))
        results[f"build{world}"] = rank_results(dirs[world], "build", world)
    for world in WORLDS:
        cache = base / f"inductor-cache-{world}"
        cache.mkdir()
        other = [str(dirs[w]) for w in WORLDS if w != world][:1] if world == 4 else []
        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(cache),  # empty: nothing cached to fall back on
            "CXX": "/bin/false",  # any C++ compile would fail
        }
        torchrun("dist_job", world, "load", str(dirs[world]), *other, env=env)
        results[f"load{world}"] = rank_results(dirs[world], "load", world)
        results[f"cache{world}"] = sorted(p.name for p in cache.rglob("*") if p.is_file())
    cache = base / "inductor-cache-orders"
    cache.mkdir()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "CXX": "/bin/false"}
    torchrun("dist_job", 2, "orders", str(dirs[2]), env=env)
    results["orders"] = rank_results(dirs[2], "orders", 2)
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_compiled_once_saved_once(jobs: dict[str, Any], world: int) -> None:
    build = jobs[f"build{world}"]
    assert set(build[0]["compile_s"]) == set(MODELS)
    assert all(not r["compile_s"] for r in build[1:]), "only rank 0 compiles"
    names = sorted(p.name for p in jobs["dirs"][world].iterdir() if not p.name.endswith(".lock"))
    for model in MODELS:
        assert f"{model}.pt" in names
        shards = [n for n in names if n.startswith(f"{model}.pt.rank")]
        assert shards == [f"{model}.pt.rank{r}-of-{world}" for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_reads_only_its_own_shard(jobs: dict[str, Any], world: int) -> None:
    for rank, res in enumerate(jobs[f"load{world}"]):
        expected = sorted(
            [f"{m}.pt" for m in MODELS] + [f"{m}.pt.rank{rank}-of-{world}" for m in MODELS]
        )
        assert res["files_read"] == expected


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["mlp", "slice", "dtout", "block", "llama"])
def test_tp_inference_matches_eager(jobs: dict[str, Any], world: int, model: str) -> None:
    for res in jobs[f"load{world}"]:
        assert res["diff"][model] <= TOL  # loaded without model=: stand-in and own shard
        assert res["diff"][model + "_bound"] <= TOL  # load(path, model=live parallelised)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["train", "llama_train"])
def test_tp_training_step_matches_eager(jobs: dict[str, Any], world: int, model: str) -> None:
    tol = TRAIN_TOL[model]
    for res in jobs[f"load{world}"]:
        train = res[model]
        assert abs(train["loss_standin"] - train["loss_eager"]) <= tol
        assert abs(train["loss_bound"] - train["loss_eager"]) <= tol
        # every parameter's gradient (each rank's shard of the sharded ones)
        assert train["grad_diff_standin"] <= tol
        assert train["grad_diff_bound"] <= tol
        assert train["grads_are_dtensor"]  # gradients land on the live DTensor parameters
    # the plan sharded up/down, or every layer's q/k/v/o and gate/up/down
    assert train["sharded_params"] == (4 if model == "train" else 2 * 7)


@pytest.mark.parametrize("world", WORLDS)
def test_dtensor_output_is_rewrapped(jobs: dict[str, Any], world: int) -> None:
    # The lean runtime rebuilds a DTensor output from the graph's local tensor with
    # the placements and global shape saved at compile time, as eager returns it.
    for res in jobs[f"load{world}"]:
        ours, bound, eager = res["output_layout_dtout"]
        assert ours == bound == eager == "DTensor [Replicate()] [4, 64]"
        # a plain tensor where eager returns one (its AsyncCollectiveTensor, waited)
        assert res["output_layout_mlp"][:2] == ["Tensor", "Tensor"]


@pytest.mark.parametrize("world", WORLDS)
def test_tp_llama_logits_are_replicated(jobs: dict[str, Any], world: int) -> None:
    for res in jobs[f"load{world}"]:
        assert res["local_shape_llama"] == [2, 16, 1000]  # the full vocabulary on every rank


@pytest.mark.parametrize("world", WORLDS)
def test_fresh_job_compiles_nothing(jobs: dict[str, Any], world: int) -> None:
    for res in jobs[f"load{world}"]:
        assert "torch._inductor.compile_fx" not in res["compiler_imported"]
    # With CXX=/bin/false a C++ compile would have failed the job; nothing was built.
    assert not [n for n in jobs[f"cache{world}"] if n.endswith(".so")]


@pytest.mark.parametrize("world", WORLDS)
def test_dtensor_artifacts_load_lean(jobs: dict[str, Any], world: int) -> None:
    # Every rank's inference artifacts (MLP, slice, block, Llama) load through
    # the lean path, standalone and with model=: the DTensor parameters' local shards
    # feed the shipped kernels, the lean guards decide every call (Dynamo's guard
    # manager is never built), and the load and first call import none of the
    # compiler stack beyond what creating one DTensor imports in any job (torch
    # itself imports sympy, torch._dynamo and AOTAutograd's runtime wrappers then).
    inference = ["mlp", "slice", "dtout", "block", "llama"]
    for res in jobs[f"load{world}"]:
        assert res["lean"] == dict.fromkeys(inference, True)
        assert res["lean_bound"] == dict.fromkeys(inference, True)
        assert res["dynamo_guards_built"] == []
        assert res["heavy_added_by_load"] == [] and res["heavy_added_by_bound_load"] == []
        assert "torch._inductor.compile_fx" not in res["heavy_before_load"]
        assert "torch._inductor.output_code" not in res["heavy_before_load"]
    for res in jobs[f"load{world}"]:  # the lean guards decide, both ways
        assert res["light_guards"] == {
            "accepts_same_layout": True,
            "accepts_again": True,
            "refuses_other_mesh": True,
        }


@pytest.mark.parametrize("world", WORLDS)
def test_dtensor_training_artifacts_load_lean(jobs: dict[str, Any], world: int) -> None:
    # The TP training steps (MLP, Llama) run forward and backward on the
    # lean path, standalone and with model=: DTensor parameters enter the lean
    # autograd.Function, their local shards feed the compiled forward, and each
    # gradient is rebuilt as a DTensor shard (test_tp_training_step_matches_eager
    # compares them with eager's); the lean guards decide, and the steps import
    # nothing of the compiler stack.
    for res in jobs[f"load{world}"]:
        assert res["lean_train"] == {
            "train": True,
            "llama_train": True,
            "train_bound": True,
            "llama_train_bound": True,
        }
        assert res["dynamo_guards_built_train"] == []
        assert res["heavy_added_by_training"] == []
        assert "torch._inductor.compile_fx" not in res["compiler_imported"]


def test_any_order_of_steps(jobs: dict[str, Any]) -> None:
    # The job parallelises its own models on its own mesh around
    # standalone loads, each building its own mesh; no mesh=.
    for res in jobs["orders"]:
        # Built after a load whose weights a DTensor op touched, the model's weights
        # got the load's (equal) mesh from DTensor's sharding cache, its hooks the
        # job's: the case to serve.
        assert res["block_weight_on_load_mesh"]
        for case in (
            "mlp_built_first",
            "mlp_twice",
            "block_standin",
            "block_bound_after",
            "mlp_first_again",
        ):
            assert res[case] <= TOL, case
        assert res["train_loss_diff"] <= 1e-6 and res["train_grad_diff"] <= 1e-6


def test_traced_parallel_hooks_are_not_refused_hooks(jobs: dict[str, Any]) -> None:
    # parallelize_module's hooks ran in the trace: the "no module hooks" entry
    # covers only the model itself, not the submodules holding those hooks.
    cmd = [sys.executable, "-m", "torch_precompile", "inspect", str(jobs["dirs"][2] / "mlp.pt")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in text.splitlines() if "no module hooks" in ln)
    assert "no module hooks: the model has no forward" in line
    assert "submodule" not in line


def test_world_size_mismatch_is_a_typed_error(jobs: dict[str, Any]) -> None:
    for res in jobs["load4"]:
        message = res["world_error"]
        assert message is not None, "loading a 2-rank artifact in a 4-rank job must fail"
        assert "saved for world size 2" in message and "this job has world size 4" in message
        assert "--nproc-per-node 2" in message


def test_placement_mismatch_names_both(jobs: dict[str, Any]) -> None:
    for res in jobs["load2"]:
        message = res["placement_error"]
        assert message is not None
        assert "'up.weight'" in message
        assert "['Shard(0)']" in message and "['Shard(1)']" in message


def test_fsdp2_whole_module_capture_is_refused(jobs: dict[str, Any]) -> None:
    # FSDP2's hooks are wrapped in torch._dynamo.disable: no single graph exists.
    assert jobs["build2"][0]["fsdp2_capture"].startswith("CaptureError")


def test_load_without_process_group_is_a_typed_error(jobs: dict[str, Any]) -> None:
    from torch_precompile import Precompile

    assert not torch.distributed.is_initialized()
    with pytest.raises(DistributedLayoutError) as info:
        Precompile.load(jobs["dirs"][2] / "mlp.pt")
    message = str(info.value)
    assert "world size 2" in message and "no process group" in message
    assert "init_process_group" in message


def test_layout_error_type() -> None:
    exc = DistributedLayoutError("f.pt", "world size 2", "world size 4", "run 2 ranks")
    assert isinstance(exc, IncompatibleSystemError) and isinstance(exc, PrecompileError)
    assert (
        str(exc)
        == "f.pt: the artifact was saved for world size 2, this job has world size 4; run 2 ranks"
    )
    again = pickle.loads(pickle.dumps(exc))
    assert str(again) == str(exc) and again.saved == "world size 2"
