"""A torchrun job that trains sharded data-parallel models from one compiled file.

Run by ``tests/test_data_parallel.py``::

    torchrun --standalone --nproc-per-node 2 examples/dp_job.py build DIR
    torchrun --standalone --nproc-per-node 2 examples/dp_job.py load DIR

Each model (``examples/tp_models.py``'s MLP, ``mlp``, and its Hugging Face
Llama, ``llama``) is sharded with :func:`torch_precompile.shard_parameters`
(every parameter a ``Shard(0)`` DTensor, gathered in the forward, gradients
reduce-scattered). ``build``: rank 0 alone compiles its training step (the
MLP through the staged pipeline, recording the collectives of its joint
graph) and saves the code file and its shard; every other rank writes only
its shard.
``load``: a fresh job loads each file on every rank (without ``model=``, and
the MLP also bound to a live sharded model) and trains 3 optimizer steps
(SGD with momentum), each rank on its own
batch, beside the same sharded model trained eagerly; it records each step's
losses and the largest difference of the gradient shards and, for the MLP,
the artifact's full (gathered) gradient against a plain model's gradients
averaged over every rank's batch. Each rank writes ``DIR/<phase>-<world>-rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import rank_job  # noqa: E402

# TP_DEVICE=cuda: NCCL and one GPU per rank (float32 models), else gloo on the CPU.
DEVICE = rank_job.one_gpu_per_rank()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.tp_models import LLAMA_VOCAB, build  # noqa: E402
from torch_precompile import (  # noqa: E402
    DistributedLayoutError,
    Precompile,
    save_shard,
    shard_parameters,
)

MODELS = ("mlp", "llama")
STEPS = 3


def make(name: str, mesh: Any) -> torch.nn.Module:
    """The model ``name``, the same on every rank, then sharded over ``mesh``."""
    return shard_parameters(build(name, None).to(DEVICE).train(), mesh)


def batch(name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s own batch (data parallel: every rank sees other data)."""
    g = torch.Generator().manual_seed(100 + rank)
    if name == "llama":
        return torch.randint(0, LLAMA_VOCAB, (2, 16), generator=g).to(DEVICE)
    return torch.randn(4, 64, generator=g).to(DEVICE)


def loss_of(model: Any, name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "llama":  # next-token cross-entropy
        logits = model(x, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    return model(x).square().mean()


def optimizer(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum over the local shards. (AdamW works as well, but its first
    steps divide by the gradients' own size, so a 1e-9 difference of a near-zero
    gradient, Inductor's rounding, becomes a 1e-4 difference of the weights.)"""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def collectives(joint: torch.fx.GraphModule) -> dict[str, int]:
    """How many of each c10d functional collective the joint graph calls."""
    counts: dict[str, int] = {}
    for node in joint.graph.nodes:
        op = str(node.target)
        if node.op == "call_function" and op.startswith("_c10d_functional."):
            name = op.split(".")[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def build_phase(out: Path, mesh: Any, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"compile_s": {}}
    for name in MODELS:
        model = make(name, mesh)
        path = out / f"{name}.pt"
        if rank == 0:
            start = time.perf_counter()
            if name == "mlp":  # the staged pipeline, to read the joint graph's collectives
                gm, _, guards = Precompile.dynamo(model, (batch(name, rank),))
                joint, guards = Precompile.aot_autograd(gm, guards)
                result["collectives"] = collectives(joint)
                compiled, guards = Precompile.inductor(joint, guards)
                artifact = Precompile.precompile(compiled)
            else:
                x = batch(name, rank)
                artifact = Precompile.compile(model, (x,), {"use_cache": False})
            result["compile_s"][name] = time.perf_counter() - start
            Precompile.save(path, artifact)  # the code file and rank 0's shard
        else:
            save_shard(path, model)
    dist.barrier()
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_shard0(t: Any) -> bool:
    """A DTensor placed Shard(0), holding this rank's slice of the global shape."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(t, DTensor)
        and tuple(t.placements) == (Shard(0),)
        and t.to_local().shape[0] * t.device_mesh.size() == t.shape[0]
    )


def train(name: str, fn: Any, params: list[Any], eager: torch.nn.Module, rank: int) -> dict:
    """``STEPS`` optimizer steps of ``fn`` (the artifact) over ``params`` beside ``eager``."""
    x = batch(name, rank)
    opts = optimizer(params), optimizer(list(eager.parameters()))
    record: dict[str, Any] = {"loss": [], "loss_eager": [], "grad_diff": []}
    for _ in range(STEPS):
        loss = loss_of(fn, name, x)
        loss.backward()
        loss_eager = loss_of(eager, name, x)
        loss_eager.backward()
        record["grads_sharded"] = all(_is_shard0(p.grad) for p in params)
        record["loss"].append(float(loss.detach()))
        record["loss_eager"].append(float(loss_eager.detach()))
        record["grad_diff"].append(
            max(
                float((_local(p.grad) - _local(q.grad)).abs().max())
                for p, q in zip(params, eager.parameters(), strict=True)
            )
        )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    record["param_diff"] = max(
        float((_local(p) - _local(q)).detach().abs().max())
        for p, q in zip(params, eager.parameters(), strict=True)
    )
    return record


def reference_grad_diff(name: str, model: Any, world: int, rank: int) -> float:
    """``model``'s gathered gradients (one backward on this rank's batch, from none) against a plain
    model's gradients averaged over every rank's batch: what data-parallel training means."""
    loss_of(model, name, batch(name, rank)).backward()
    plain = build(name, None).to(DEVICE).train()
    for r in range(world):
        (loss_of(plain, name, batch(name, r)) / world).backward()
    grads = {k: p.grad for k, p in plain.named_parameters()}
    diff = 0.0
    for key, p in model.named_parameters():
        full = p.grad.full_tensor()  # a collective: every rank gathers
        plain_key = key.replace("parametrizations.", "").replace(".original", "")
        diff = max(diff, float((full - grads[plain_key]).abs().max()))
    return diff


def load_phase(out: Path, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    opened: list[str] = []

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(str(out)):
            opened.append(os.path.basename(args[0]))

    sys.addaudithook(audit)  # which files of the artifacts this rank reads
    loaded = {name: Precompile.load(out / f"{name}.pt") for name in MODELS}
    result["files_read"] = sorted(set(opened))
    for name in MODELS:
        standin = loaded[name]
        result[name] = train(name, standin, list(standin.parameters()), make(name, mesh), rank)
    live = make("mlp", mesh)
    bound = Precompile.load(out / "mlp.pt", model=live)
    result["mlp_bound"] = train("mlp", bound, list(live.parameters()), make("mlp", mesh), rank)
    # Issue 27: forward and backward ran on the lean path, the lean guards deciding.
    result["lean"] = {name: rank_job.lean(loaded[name]) for name in MODELS}
    result["lean"]["mlp_bound"] = rank_job.lean(bound)
    result["dynamo_guards_built"] = sorted(
        name for name in MODELS if rank_job.dynamo_guards(loaded[name])
    )
    fresh = Precompile.load(out / "mlp.pt")  # the saved weights again
    result["mlp_reference_grad_diff"] = reference_grad_diff("mlp", fresh, world, rank)
    try:  # the plain (unsharded) model bound to the data-parallel artifact
        Precompile.load(out / "mlp.pt", model=build("mlp", None).to(DEVICE))
        result["plain_model_error"] = None
    except DistributedLayoutError as exc:
        result["plain_model_error"] = str(exc)
    try:  # 5 rows over 2 or 4 ranks: shards of unequal shapes
        shard_parameters(torch.nn.Linear(8, 5).to(DEVICE), mesh)
        result["uneven_error"] = None
    except ValueError as exc:
        result["uneven_error"] = str(exc)
    # Nothing compiled: Inductor's compile entry point was never imported.
    result["compiler_imported"] = "torch._inductor.compile_fx" in sys.modules
    return result


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])

    def body(mesh: Any, rank: int, world: int) -> tuple[str, dict[str, Any]]:
        if phase == "build":
            return phase, build_phase(out, mesh, rank)
        return phase, load_phase(out, mesh, rank, world)

    rank_job.run(DEVICE, out, phase, body)


if __name__ == "__main__":
    main()
