"""A torchrun job that compiles, saves and loads tensor-parallel artifacts.

Run by ``tests/test_distributed.py`` and ``benchmarks/distributed.py``::

    torchrun --standalone --nproc-per-node 2 examples/dist_job.py build DIR
    torchrun --standalone --nproc-per-node 2 examples/dist_job.py load DIR
    torchrun --standalone --nproc-per-node 4 examples/dist_job.py load DIR4 DIR2
    torchrun ... examples/dist_job.py compile_all DIR        # every rank compiles
    torchrun ... examples/dist_job.py first DIR ours block   # or eager / jit
    torchrun ... examples/dist_job.py orders DIR             # build before load, load twice

``build``: rank 0 alone compiles each model (``mlp``, ``slice``, ``dtout`` (the MLP
returning a DTensor), ``block`` and
a Hugging Face ``llama`` for inference; ``train`` and ``llama_train``: the MLP
and the Llama with grad enabled) and saves the code file and its shard;
every other rank writes only its shard (``save_shard``). ``load``: a fresh
job loads every file (without ``model=`` and with a live parallelised
``model=``), runs it, and compares with the same parallelised model run
eagerly; given a second directory saved by a job of another world size, it
records the error loading from there raises. ``orders``: the job builds its
own models around standalone loads, on its own mesh (no ``use_device_mesh``).
``build`` also records what capturing an FSDP2 (``fully_shard``) model raises. Each rank writes
``DIR/<phase>-<world>-rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import rank_job  # noqa: E402

# TP_DEVICE=cuda: NCCL and a CUDA mesh (one GPU per rank), else gloo on the CPU.
DEVICE = rank_job.one_gpu_per_rank()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from examples.tp_models import build, example_input, run  # noqa: E402
from torch_precompile import (  # noqa: E402
    DistributedLayoutError,
    Precompile,
    save_shard,
    use_device_mesh,
)

INFERENCE = ("mlp", "slice", "dtout", "block", "llama")
TRAIN = {"train": "mlp", "llama_train": "llama"}  # artifact -> the model it trains
# The compiler stack a lean load leaves alone. torch imports some of it with
# DTensor itself, in eager jobs too: sympy (torch.distributed.tensor imports
# torch.fx.experimental.symbolic_shapes), torch._dynamo and AOTAutograd's
# runtime wrappers (DTensor.__new__ is wrapped in torch._disable_dynamo, which
# imports torch._dynamo on a first call); the load may add none of them.
HEAVY_MODULES = (
    "sympy",
    "torch._dynamo",
    "torch._dynamo.convert_frame",
    "torch._dynamo.guards",
    "torch._functorch._aot_autograd.runtime_wrappers",
    "torch._inductor.compile_fx",
    "torch._inductor.output_code",
)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _layout(t: Any) -> str:
    """A DTensor's class, placements and global shape; a plain tensor's class."""
    if hasattr(t, "placements"):
        return f"{type(t).__name__} {list(t.placements)} {list(t.shape)}"
    return type(t).__name__


def _heavy() -> set[str]:
    return {m for m in HEAVY_MODULES if m in sys.modules}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((_local(a).detach() - _local(b).detach()).abs().max())


def _train_step(fn: Any, params: Any, name: str, x: torch.Tensor) -> tuple[float, dict]:
    """One forward and backward of ``name`` through ``fn``: the loss, and the
    gradient of each of ``params`` (``named_parameters()``) by name."""
    out = run(fn, name, x)
    if name == "llama":  # next-token cross-entropy
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    else:
        loss = out.square().mean()
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in params}


def _grad_diff(grads: dict[str, Any], expected: dict[str, Any]) -> float:
    assert grads.keys() == expected.keys(), (sorted(grads), sorted(expected))
    return max(_max_diff(grads[k], expected[k]) for k in expected)


def build_phase(out: Path, mesh: Any, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"compile_s": {}}
    for name in (*INFERENCE, *TRAIN):
        model = build(TRAIN.get(name, name), mesh)
        x = example_input(TRAIN.get(name, name), DEVICE)
        path = out / f"{name}.pt"
        if rank == 0:
            start = time.perf_counter()
            kwargs = {"use_cache": False} if TRAIN.get(name, name) == "llama" else {}
            if name in TRAIN:
                artifact = Precompile.compile(model.train(), (x,), kwargs)
            else:
                with torch.no_grad():
                    artifact = Precompile.compile(model.eval(), (x,), kwargs)
            result["compile_s"][name] = time.perf_counter() - start
            Precompile.save(path, artifact)  # the code file and rank 0's shard
        else:
            save_shard(path, model)
    if rank == 0:
        result["fsdp2_capture"] = _try_fsdp2(mesh)
    dist.barrier()
    return result


def _try_fsdp2(mesh: Any) -> str:
    """What capturing a whole FSDP2 module raises (its hooks are Dynamo-disabled)."""
    from torch.distributed.fsdp import fully_shard

    model = build("mlp", None).to(DEVICE)
    fully_shard(model, mesh=mesh)
    try:
        Precompile.compile(model, example_input("mlp", DEVICE))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "captured"


def load_phase(out: Path, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    opened: list[str] = []

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(str(out)):
            opened.append(os.path.basename(args[0]))

    sys.addaudithook(audit)  # which files of the artifacts this rank reads
    from torch.distributed.tensor import DTensor

    DTensor.from_local(torch.zeros(1, device=DEVICE), mesh)  # what any DTensor job imports
    result["heavy_before_load"] = sorted(_heavy())
    start = time.perf_counter()
    loaded = {name: Precompile.load(out / f"{name}.pt") for name in INFERENCE}
    result["load_s"] = time.perf_counter() - start
    outputs = {}
    with torch.no_grad():
        for name in INFERENCE:
            outputs[name] = run(loaded[name], name, example_input(name, DEVICE))
    result["first_output_s"] = time.perf_counter() - T0
    result["heavy_added_by_load"] = sorted(_heavy() - set(result["heavy_before_load"]))
    result["dynamo_guards_built"] = sorted(
        n for n in INFERENCE if rank_job.dynamo_guards(loaded[n])
    )
    result["diff"] = {}
    bound_lean = {}
    for name in INFERENCE:
        eager = build(name, mesh).eval()
        bound = Precompile.load(out / f"{name}.pt", model=eager)
        bound_lean[name] = rank_job.lean(bound)
        x = example_input(name, DEVICE)
        with torch.no_grad():
            expected = run(eager, name, x)
            result["diff"][name] = _max_diff(outputs[name], expected)
            bound_out = run(bound, name, x)
            result["diff"][name + "_bound"] = _max_diff(bound_out, expected)
        if rank_job.dynamo_guards(bound):
            result["dynamo_guards_built"].append(name + "_bound")
        result["local_shape_" + name] = list(_local(outputs[name]).shape)
        result["output_layout_" + name] = [
            _layout(outputs[name]),
            _layout(bound_out),
            _layout(expected),
        ]
    # Issue 27: the DTensor artifacts loaded (standalone and with model=) and ran
    # through the lean path, without the compiler stack.
    result["lean"] = {name: rank_job.lean(loaded[name]) for name in INFERENCE}
    result["lean_bound"] = bound_lean
    result["heavy_added_by_bound_load"] = sorted(_heavy() - set(result["heavy_before_load"]))
    start = time.perf_counter()
    loaded.update({name: Precompile.load(out / f"{name}.pt") for name in TRAIN})
    result["load_s"] += time.perf_counter() - start
    result["files_read"] = sorted(set(opened))
    opened.clear()
    heavy = _heavy()
    standin_steps = {
        name: _train_step(
            loaded[name], loaded[name].named_parameters(), model, example_input(model, DEVICE)
        )
        for name, model in TRAIN.items()
    }
    # Issue 27: the training artifacts, forward and backward, on the lean path too.
    result["lean_train"] = {name: rank_job.lean(loaded[name]) for name in TRAIN}
    result["dynamo_guards_built_train"] = sorted(
        n for n in TRAIN if rank_job.dynamo_guards(loaded[n])
    )
    result["heavy_added_by_training"] = sorted(_heavy() - heavy)
    # Nothing compiled: Inductor's compile entry point was never imported.
    result["compiler_imported"] = sorted(
        m for m in ("torch._inductor.compile_fx", "torch._inductor.codecache") if m in sys.modules
    )
    for name, model in TRAIN.items():
        x = example_input(model, DEVICE)
        eager = build(model, mesh).train()
        loss_eager, grads_eager = _train_step(eager, eager.named_parameters(), model, x)
        live = build(model, mesh).train()
        bound = Precompile.load(out / f"{name}.pt", model=live)
        loss_bound, grads_bound = _train_step(bound, live.named_parameters(), model, x)
        loss_standin, grads_standin = standin_steps[name]
        sharded = [k for k, p in live.named_parameters() if hasattr(p, "to_local")]
        result["lean_train"][name + "_bound"] = rank_job.lean(bound)
        result[name] = {
            "loss_eager": loss_eager,
            "loss_standin": loss_standin,
            "loss_bound": loss_bound,
            "grad_diff_standin": _grad_diff(grads_standin, grads_eager),
            "grad_diff_bound": _grad_diff(grads_bound, grads_eager),
            "sharded_params": len(sharded),
            # gradients land on the live DTensor parameters, as DTensor shards
            "grads_are_dtensor": all(hasattr(grads_bound[k], "to_local") for k in sharded),
        }
    # A live model parallelised differently: up row-wise, down column-wise.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    swapped = build("mlp", None).to(DEVICE)
    parallelize_module(swapped, mesh, {"up": RowwiseParallel(), "down": ColwiseParallel()})
    try:
        Precompile.load(out / "mlp.pt", model=swapped)
        result["placement_error"] = None
    except DistributedLayoutError as exc:
        result["placement_error"] = str(exc)
    result["light_guards"] = _light_guard_checks(out, mesh, world)
    if len(sys.argv) > 3:  # files saved by a job of another world size
        try:
            Precompile.load(Path(sys.argv[3]) / "mlp.pt")
            result["world_error"] = None
        except DistributedLayoutError as exc:
            result["world_error"] = str(exc)
    return result


def _light_guard_checks(out: Path, mesh: Any, world: int) -> dict[str, bool] | None:
    """The lean load's lean guards of the MLP on live models: the same layout
    (accepted, twice: the second time from what the first remembered), and the
    same placements on a mesh with other dimension names (refused: Dynamo's
    DTensor and mesh guards compare the names). None: the MLP has no lean guards."""
    manager = Precompile.load(out / "mlp.pt").compiled_function._artifacts.guard_manager
    light = getattr(manager, "lean_guards", None)
    if light is None:  # the lean path with Dynamo's guard manager, or the full path
        return None
    x = example_input("mlp", DEVICE)
    same = build("mlp", mesh).eval()
    named = init_device_mesh(DEVICE, (world,), mesh_dim_names=("tp",))
    other = build("mlp", named).eval()
    with torch.no_grad():  # as captured (grad mode is guarded too)
        return {
            "accepts_same_layout": light.check({"self": same, "x": x}),
            "accepts_again": light.check({"self": same, "x": x}),
            "refuses_other_mesh": not light.check({"self": other, "x": x}),
        }


def orders_phase(out: Path, mesh: Any) -> dict[str, Any]:
    """The user's order of steps, with no ``use_device_mesh``: the job builds and
    parallelises its own model on its own mesh before loading, loads one file
    twice, and builds another model after loading it (then binds that one).
    DTensor's sharding cache then hands parameters the other, equal mesh."""
    result: dict[str, Any] = {}
    x = example_input("mlp", DEVICE)
    with torch.no_grad():
        expected = build("mlp", mesh).eval()(x)  # built before any load
        first = Precompile.load(out / "mlp.pt")
        result["mlp_built_first"] = _max_diff(first(x), expected)
        second = Precompile.load(out / "mlp.pt")  # the same file again
        result["mlp_twice"] = _max_diff(second(x), expected)
        xb = example_input("block", DEVICE)
        block = Precompile.load(out / "block.pt")
        eager = build("block", mesh).eval()  # built after loading it
        # The cache gave the new model's weights the load's mesh, its hooks the job's.
        result["block_weight_on_load_mesh"] = eager.q.weight.device_mesh is not mesh
        expected_block = eager(xb)
        result["block_standin"] = _max_diff(block(xb), expected_block)
        bound = Precompile.load(out / "block.pt", model=eager)
        result["block_bound_after"] = _max_diff(bound(xb), expected_block)
        result["mlp_first_again"] = _max_diff(first(x), expected)
    train = Precompile.load(out / "train.pt")
    loss, grads = _train_step(train, train.named_parameters(), "mlp", x)
    eager = build("mlp", mesh)
    loss_eager, grads_eager = _train_step(eager, eager.named_parameters(), "mlp", x)
    result["train_loss_diff"] = abs(loss - loss_eager)
    result["train_grad_diff"] = _grad_diff(grads, grads_eager)
    return result


def compile_all_phase(mesh: Any) -> dict[str, Any]:
    """Today's way: every rank compiles the same program (``Precompile.compile``)."""
    result: dict[str, Any] = {"compile_s": {}}
    for name in INFERENCE:
        model = build(name, mesh).eval()
        start = time.perf_counter()
        kwargs = {"use_cache": False} if name == "llama" else {}
        with torch.no_grad():
            Precompile.compile(model, (example_input(name, DEVICE),), kwargs)
        result["compile_s"][name] = time.perf_counter() - start
    dist.barrier()
    return result


def first_output_phase(out: Path, mesh: Any, how: str, name: str) -> dict[str, Any]:
    """Seconds from process start to this rank's first output of ``name``: ``eager``
    (build and parallelise the model), ``jit`` (that, then ``torch.compile``) or
    ``ours`` (``Precompile.load`` of the saved files)."""
    x = example_input(name, DEVICE)
    result: dict[str, Any] = {}
    with torch.no_grad():
        if how == "ours":
            artifact = Precompile.load(out / f"{name}.pt")
            y = run(artifact, name, x)
            result["lean"] = rank_job.lean(artifact)
        else:
            model = build(name, mesh).eval()
            y = run(torch.compile(model) if how == "jit" else model, name, x)
    result["first_output_s"] = time.perf_counter() - T0
    result["shape"] = list(y.shape)
    result["heavy_imported"] = sorted(_heavy())
    return result


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])

    def body(mesh: Any, rank: int, world: int) -> tuple[str, dict[str, Any]]:
        name = phase
        if phase == "orders":
            result = orders_phase(out, mesh)
        else:
            use_device_mesh(mesh)  # the eager references below build on this mesh too
            if phase == "build":
                result = build_phase(out, mesh, rank)
            elif phase == "compile_all":
                result = compile_all_phase(mesh)
            elif phase == "first":
                result = first_output_phase(out, mesh, sys.argv[3], sys.argv[4])
                name = f"first-{sys.argv[3]}-{sys.argv[4]}"
            else:
                result = load_phase(out, mesh, rank, world)
        return name, {**result, "total_s": time.perf_counter() - T0}

    rank_job.run(DEVICE, out, phase, body)


if __name__ == "__main__":
    main()
