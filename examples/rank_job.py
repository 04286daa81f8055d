"""What the examples' torchrun jobs share: a GPU per rank, the process group and
mesh, and one JSON result per rank (``DIR/<phase>-<world>-rank<r>.json``).

Importable before ``torch``: :func:`one_gpu_per_rank` must run first.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def one_gpu_per_rank() -> str:
    """The job's device type (``TP_DEVICE``, default ``cpu``). With ``cuda``, each
    rank sees its own GPU as ``cuda:0``: a CUDA artifact runs on the device index
    it was compiled for (rank 0 compiles on its ``cuda:0``). Call before
    importing torch."""
    device = os.environ.get("TP_DEVICE", "cpu")
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        local = int(os.environ["LOCAL_RANK"])
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local] if visible[0] else str(local)
    return device


Body = Callable[[Any, int, int], tuple[str, dict[str, Any]]]


def run(device: str, out: Path, phase: str, body: Body) -> None:
    """Start the process group (NCCL on GPUs, gloo on the CPU) and a 1-D mesh, run
    ``body(mesh, rank, world)`` (it returns the result's name and the result), and
    write this rank's result; a failure is written as ``{"error": traceback}``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # Dynamo guards the thread count; N ranks share 2 cores
    if device == "cuda":
        torch.cuda.set_device(0)  # this rank's GPU (see one_gpu_per_rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    try:
        phase, result = body(mesh, rank, world)
    except Exception:
        result = {"error": traceback.format_exc()}
    (out / f"{phase}-{world}-rank{rank}.json").write_text(json.dumps(result, indent=1))
    if "error" in result:
        # Another rank may be waiting for this one in a collective: end the job
        # (torchrun stops the other ranks) rather than leave it hanging.
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()


def lean(artifact: Any) -> bool:
    """Whether ``artifact`` was loaded by the lean path (no Dynamo, AOTAutograd, Inductor)."""
    return type(artifact.compiled_function).__name__ == "LeanCompiledFunction"


def dynamo_guards(artifact: Any) -> bool:
    """Whether Dynamo's guard manager was built for ``artifact`` (the lean guards
    could not decide a call); a lean load's lean guards decide alone."""
    manager = artifact.compiled_function._artifacts.guard_manager
    return getattr(manager, "_full", True) is not None
