"""The layout of a parallelised model: its mesh, each DTensor's placements and
global shape, recorded once and compared at load."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

import torch

from .._compat import distributed as _cdist
from .._errors import ArtifactCorruptedError, DistributedLayoutError
from ..lean.standin import module as _standin

LAYOUT_VERSION = 1


def _dist() -> Any:
    """``torch.distributed`` when it is built in and a process group is up, else None."""
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def _dtensor_type() -> type | None:
    """DTensor, if this process imported it (no DTensor exists otherwise): saving or
    capturing a plain model must not pay for importing torch.distributed.tensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def encode_placement(p: Any) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``: a placement in words (and JSON)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    raise ValueError(f"placement {p!r} is not supported by torch_precompile's shard files")


def decode_placement(text: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    name, _, arg = text.rstrip(")").partition("(")
    if name == "Shard":
        return Shard(int(arg))
    if name == "Replicate":
        return Replicate()
    if name == "Partial":
        return Partial(arg)
    raise ArtifactCorruptedError(f"unknown placement {text!r} in the distributed layout")


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """A DeviceMesh in words: shape, dimension names, device type, c10d group names."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    device_type: str
    group_names: tuple[str, ...]

    def describe(self) -> str:
        names = f", dims {list(self.dim_names)}" if self.dim_names else ""
        return f"mesh {self.device_type} {list(self.shape)}{names}"


@dataclasses.dataclass(frozen=True)
class ShardedTensor:
    """One DTensor parameter or buffer: its global shape and stride and placements."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[str, ...]
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a distributed artifact was saved for: the job and every DTensor's placement."""

    world_size: int
    backend: str
    mesh: MeshInfo
    tensors: dict[str, ShardedTensor]
    # Traced under compile_on_one_rank: the graph computes the rank's coordinate
    # at run time and holds the mesh, which the loader binds (see deserializing).
    one_rank: bool = False
    saved_by_rank: int = 0

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["version"] = LAYOUT_VERSION
        body["layout_id"] = self.layout_id
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Layout:
        mesh = body["mesh"]
        return cls(
            world_size=int(body["world_size"]),
            backend=str(body["backend"]),
            mesh=MeshInfo(
                tuple(mesh["shape"]),
                tuple(mesh["dim_names"]) if mesh["dim_names"] is not None else None,
                mesh["device_type"],
                tuple(mesh["group_names"]),
            ),
            tensors={
                name: ShardedTensor(
                    tuple(t["shape"]),
                    tuple(t["stride"]),
                    tuple(t["placements"]),
                    bool(t["requires_grad"]),
                )
                for name, t in body["tensors"].items()
            },
            one_rank=bool(body.get("one_rank", False)),
            saved_by_rank=int(body.get("saved_by_rank", 0)),
        )

    @property
    def layout_id(self) -> str:
        """A digest of everything but the saving rank: equal on every rank of the job,
        so a shard file is matched to its code file whichever rank wrote it."""
        body = dataclasses.asdict(self)
        body.pop("saved_by_rank")
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"world size {self.world_size} ({self.backend}), {self.mesh.describe()}"


def _mesh_info(mesh: Any) -> MeshInfo:
    """A mesh in words. A 1-D mesh over the world names one group, the same on every
    rank; the groups of a mesh of more dimensions differ by rank (rank 0's
    ``tp`` group is not rank 2's), so none are recorded: a graph traced under
    ``compile_on_one_rank`` reaches them through the mesh at run time."""
    return MeshInfo(
        tuple(mesh.shape),
        tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        mesh.device_type,
        tuple(_cdist.mesh_group_names(mesh)) if mesh.ndim == 1 else (),
    )


def _sharded(module: torch.nn.Module) -> dict[str, Any]:
    """The module's DTensor parameters and buffers, under :func:`module_tensors`' names."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return {}
    return {k: t for k, t in _standin.module_tensors(module).items() if isinstance(t, dtensor)}


def describe(module: Any) -> Layout | None:
    """The layout of a parallelised module; None when it holds no DTensor."""
    if not isinstance(module, torch.nn.Module):
        return None
    sharded = _sharded(module)
    if not sharded:
        return None
    dist = _dist()
    if dist is None:
        raise DistributedLayoutError(
            "saving a model with DTensor parameters",
            "a process group",
            "none (torch.distributed is not initialized)",
            "call torch.distributed.init_process_group() before saving",
        )
    meshes = {id(t.device_mesh): t.device_mesh for t in sharded.values()}
    if len(meshes) != 1:
        raise ValueError(
            f"the model's DTensors live on {len(meshes)} device meshes; torch_precompile saves "
            "models parallelised over one mesh"
        )
    mesh = next(iter(meshes.values()))
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the model's device mesh spans {mesh.size()} of the job's "
            f"{dist.get_world_size()} ranks; torch_precompile saves models parallelised over "
            "a mesh of the whole world"
        )
    if mesh.ndim > 1 and not (
        _cdist.compile_on_one_rank_available() and _cdist.submeshes_at_run_time()
    ):
        raise ValueError(
            f"the model's device mesh has {mesh.ndim} dimensions; this torch "
            f"({torch.__version__}) traces a submesh's process group as the compiling rank's "
            "(no compile_on_one_rank, or no run-time submesh op), which the other ranks do "
            "not have: use torch 2.13 or later, or a model parallelised over a 1-D mesh"
        )
    return Layout(
        world_size=dist.get_world_size(),
        backend=str(dist.get_backend()),
        mesh=_mesh_info(mesh),
        tensors={
            name: ShardedTensor(
                tuple(t.shape),
                tuple(t.stride()),
                tuple(encode_placement(p) for p in t.placements),
                bool(t.requires_grad),
            )
            for name, t in sharded.items()
        },
        one_rank=_cdist.compile_on_one_rank_available(),
        saved_by_rank=dist.get_rank(),
    )


def _mesh_key(info: MeshInfo) -> tuple[Any, ...]:
    return (info.device_type, info.shape, info.dim_names)
