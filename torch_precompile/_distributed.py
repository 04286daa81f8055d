"""One artifact for every rank of a torch.distributed job (DTensor tensor parallel).

A model parallelised with ``parallelize_module`` holds DTensor parameters:
each rank its own shard. The compiled code is the same on every rank: the
stages trace such a model under ``compile_on_one_rank`` (:func:`one_rank_tracing`),
so a rank's mesh coordinate is computed at run time and the process groups
are reached through the DeviceMesh, which the loader binds to the rank's
live mesh (:func:`deserializing`). It is saved once; the shards are
rank-specific, so each rank's shard goes to its own file:

- ``PATH``: the code file, an ordinary artifact whose header carries the
  layout (world size, mesh, each DTensor's placements and global shape) and
  whose ``weights`` hold only the plain (replicated) tensors;
- ``PATH.rank<r>-of-<n>``: rank ``r``'s local shards, in the same container.

Loading reads the code file and the rank's own shard file, never another
rank's. The layout is checked first: another world size, mesh shape,
process-group naming or placement raises :class:`DistributedLayoutError`
naming both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ._compat import distributed as _cdist
from ._errors import ArtifactCorruptedError, DistributedLayoutError
from .file import read_artifact, write_artifact
from .file import standin as _standin

log = logging.getLogger("torch_precompile")

LAYOUT_VERSION = 1
_MESHES: dict[tuple[Any, ...], Any] = {}
HOOKS_SECTION = "distributed_hooks"


def _dist() -> Any:
    """``torch.distributed`` when it is built in and a process group is up, else None."""
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def _dtensor_type() -> type | None:
    """DTensor, if this process imported it (no DTensor exists otherwise): saving or
    capturing a plain model must not pay for importing torch.distributed.tensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


# ---------------------------------------------------------------- placements


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


# -------------------------------------------------------------------- layout


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
    return MeshInfo(
        tuple(mesh.shape),
        tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        mesh.device_type,
        tuple(_cdist.mesh_group_names(mesh)),
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


def _holds_dtensors(model: Any) -> bool:
    owner = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    dtensor = _dtensor_type() if isinstance(owner, torch.nn.Module) else None
    return dtensor is not None and any(isinstance(p, dtensor) for p in owner.parameters())


@contextlib.contextmanager
def one_rank_tracing(model: Any) -> Iterator[None]:
    """Trace a model holding DTensors under ``compile_on_one_rank`` (where this
    torch has it), so that the compiled code is the same for every rank; any
    other model is traced as it is."""
    if _holds_dtensors(model) and _cdist.compile_on_one_rank_available():
        with _cdist.compile_on_one_rank():
            yield
    else:
        yield


# ---------------------------------------------------------------------- save


def shard_path(path: str | os.PathLike[str], rank: int, world_size: int) -> str:
    """``model.pt`` -> ``model.pt.rank1-of-4``: where rank 1 of 4 keeps its shard."""
    return f"{os.fspath(path)}.rank{rank}-of-{world_size}"


def code_file_parts(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """The code file's share of a parallelised module: its plain tensors, and the
    section that lets the stand-in register the parallelisation hooks again."""
    plain = {k: t for k, t in tensors.items() if k not in _sharded(module)}
    hooks, unknown = _cdist.parallel_hooks(module)
    if unknown:
        log.warning(
            "the model has %d forward hook(s) not registered by parallelize_module (first: %s); "
            "Precompile.load(path) without model= cannot rebuild them, load with model=",
            len(unknown),
            unknown[0],
        )
    return plain, {HOOKS_SECTION: pickle.dumps(hooks, protocol=pickle.HIGHEST_PROTOCOL)}


def save_shard(path: str | os.PathLike[str], model: torch.nn.Module) -> str:
    """Write this rank's shard of ``model``'s DTensors beside the code file ``path``.

    Every rank of the job calls it (the rank that saved the code file has
    already written its shard through ``Precompile.save``; calling it again
    there rewrites the same bytes). Needs no collective: the layout, and so
    the file's ``layout_id``, is the same on every rank. Returns the path
    written.
    """
    layout = describe(model)
    if layout is None:
        raise TypeError("save_shard() takes a model with DTensor parameters (parallelised)")
    rank = torch.distributed.get_rank()
    locals_ = {name: t.to_local() for name, t in _sharded(model).items()}
    out = shard_path(path, rank, layout.world_size)
    meta = {
        "distributed_shard": {
            "rank": rank,
            "world_size": layout.world_size,
            "layout_id": layout.layout_id,
        }
    }
    write_artifact(out, meta, {"weights": _standin.pack_tensors(locals_)})
    return out


# ---------------------------------------------------------------------- load


def use_device_mesh(mesh: Any) -> None:
    """Make distributed artifacts loaded without ``model=`` use ``mesh``.

    By default the first such load builds the mesh it was saved for
    (``init_device_mesh``) and later loads reuse it (or the mesh of a model
    bound with ``model=`` before). Optional: a process that also builds its
    own mesh is served either way (the stand-in's DTensors and hooks are made
    to hold one mesh object, see ``rebind_meshes``); handing the mesh over
    keeps one mesh, and one set of process groups, in the process.
    """
    _MESHES[_mesh_key(_mesh_info(mesh))] = mesh


def _mesh_key(info: MeshInfo) -> tuple[Any, ...]:
    return (info.device_type, info.shape, info.dim_names)


def check_job(body: dict[str, Any] | None, path: str, model: Any) -> Layout | None:
    """The saved layout, after checking it against this job (and ``model=`` when given).

    Raises :class:`DistributedLayoutError` naming the saved and the current
    world size, mesh or placement.
    """
    if body is None:
        return None
    layout = Layout.from_json(body)
    fix_world = (
        f"run the job with {layout.world_size} ranks (torchrun --nproc-per-node "
        f"{layout.world_size}), or compile and save again in a job of this size"
    )
    dist = _dist()
    if dist is None:
        raise DistributedLayoutError(
            f"{path}",
            layout.describe(),
            "no process group",
            "call torch.distributed.init_process_group() on every rank before Precompile.load",
        )
    world = dist.get_world_size()
    if world != layout.world_size:
        raise DistributedLayoutError(
            f"{path}", layout.describe(), f"world size {world} ({dist.get_backend()})", fix_world
        )
    if model is not None:
        _check_model(layout, model, path)
        mesh = _model_mesh(model)
        if mesh is not None:  # one mesh object; later loads without model= reuse it
            _cdist.rebind_meshes(model, mesh)
            _MESHES.setdefault(_mesh_key(_mesh_info(mesh)), mesh)
    return layout


def _model_mesh(model: Any) -> Any:
    """The mesh of a live parallelised model: the one its parallelisation hooks were
    given (the job's own), else its first DTensor's; None for a plain model."""
    sharded = _sharded(model) if isinstance(model, torch.nn.Module) else {}
    if not sharded:
        return None
    return _cdist.hook_mesh(model) or next(iter(sharded.values())).device_mesh


def _check_model(layout: Layout, model: Any, path: str) -> None:
    if not isinstance(model, torch.nn.Module):
        return  # the binding itself reports a wrong model=
    sharded = _sharded(model)
    fix = (
        "parallelise the model as it was when the artifact was compiled (same mesh and "
        "parallelize_module plan, or shard_parameters), or compile and save again"
    )
    missing = sorted(set(layout.tensors) - set(sharded))
    if missing:
        plain = missing[0] in _standin.module_tensors(model)
        raise DistributedLayoutError(
            f"{path}: model= tensor {missing[0]!r}",
            f"a DTensor placed {list(layout.tensors[missing[0]].placements)} on "
            f"{layout.mesh.describe()}",
            "a plain tensor (not parallelised)" if plain else "no tensor of that name",
            fix,
        )
    for name, t in sharded.items():
        saved = layout.tensors.get(name)
        mesh = _mesh_info(t.device_mesh)
        placements = tuple(encode_placement(p) for p in t.placements)
        if saved is None:
            raise DistributedLayoutError(
                f"{path}: model= tensor {name!r}",
                "a plain tensor",
                f"a DTensor placed {list(placements)}",
                fix,
            )
        if mesh.shape != layout.mesh.shape or mesh.dim_names != layout.mesh.dim_names:
            raise DistributedLayoutError(
                f"{path}: model= tensor {name!r}", layout.mesh.describe(), mesh.describe(), fix
            )
        if mesh.group_names != layout.mesh.group_names:
            raise DistributedLayoutError(
                f"{path}: model= mesh's process groups",
                f"groups named {list(layout.mesh.group_names)}",
                f"groups named {list(mesh.group_names)}",
                "the compiled collectives address their process group by name: build the "
                "mesh as the compiling job did (init_device_mesh over the whole world, before "
                "any other new_group)",
            )
        if placements != saved.placements or tuple(t.shape) != saved.shape:
            raise DistributedLayoutError(
                f"{path}: model= tensor {name!r}",
                f"placements {list(saved.placements)}, global shape {list(saved.shape)}",
                f"placements {list(placements)}, global shape {list(t.shape)}",
                fix,
            )


@contextlib.contextmanager
def deserializing(layout: Layout | None, model: Any, path: str) -> Iterator[None]:
    """While the compiled function of a ``compile_on_one_rank`` artifact is
    deserialized, bind the DeviceMesh its graph holds to this rank's mesh."""
    if layout is None or not layout.one_rank:
        yield
        return
    with _cdist.opaque_meshes_bound(_mesh_for(layout, model, path)):
        yield


def _mesh_for(layout: Layout, model: Any, path: str) -> Any:
    """The mesh this rank runs the artifact on: the live model's, or the one of
    this process (made on first use, see use_device_mesh)."""
    live = _model_mesh(model)
    if live is not None:
        return live
    from torch.distributed.device_mesh import init_device_mesh

    key = _mesh_key(layout.mesh)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = init_device_mesh(
            layout.mesh.device_type, layout.mesh.shape, mesh_dim_names=layout.mesh.dim_names
        )
    current = _mesh_info(mesh)
    if current.group_names != layout.mesh.group_names:
        raise DistributedLayoutError(
            f"{path}: the mesh's process groups",
            f"groups named {list(layout.mesh.group_names)}",
            f"groups named {list(current.group_names)}",
            "the compiled collectives address their process group by name: load before "
            "creating other process groups, or load with model= bound to a mesh built as in "
            "the compiling job",
        )
    return mesh


def build_standin(
    path: str,
    layout: Layout,
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    sections: dict[str, bytes],
) -> torch.nn.Module:
    """The stand-in model of this rank: plain tensors from the code file, DTensors
    from the rank's own shard file on a new mesh, the parallelisation hooks again."""
    from torch.distributed.tensor import DTensor

    rank = torch.distributed.get_rank()
    mesh = _mesh_for(layout, None, path)  # one mesh per process (see use_device_mesh)
    local = read_shard(path, layout, rank)
    device = _local_device(layout.mesh.device_type)
    for name, spec in layout.tensors.items():
        tensors[name] = DTensor.from_local(
            local[name].to(device),
            mesh,
            [decode_placement(p) for p in spec.placements],
            run_check=False,
            shape=torch.Size(spec.shape),
            stride=spec.stride,
        )
    standin = _standin.build_standin(skeleton, tensors)
    hooks = pickle.loads(sections[HOOKS_SECTION]) if HOOKS_SECTION in sections else {}
    _cdist.restore_parallel_hooks(standin, hooks, mesh)
    _cdist.rebind_meshes(standin, mesh)  # parameters may hold an equal mesh of the job
    return standin


def _local_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def read_shard(path: str, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local tensors, read from its own shard file only."""
    spath = shard_path(path, rank, layout.world_size)
    if not os.path.exists(spath):
        raise FileNotFoundError(
            f"{spath}: rank {rank}'s shard of {path} is missing; every rank of the saving job "
            "writes its own with torch_precompile.save_shard(path, model) (the saving rank's "
            "comes with Precompile.save), and each rank of a loading job needs its file"
        )
    meta, sections = read_artifact(spath)
    info = meta.get("distributed_shard") or {}
    if info.get("layout_id") != layout.layout_id:
        raise DistributedLayoutError(
            f"{spath}",
            f"layout {layout.layout_id} (the code file {path})",
            f"a shard file of layout {info.get('layout_id')}",
            "the shard file was written by another save; save the code file and every rank's "
            "shard from one job",
        )
    local = _standin.unpack_tensors(sections["weights"])
    missing = sorted(set(layout.tensors) - set(local))
    if missing:
        raise ArtifactCorruptedError(f"{spath}: the shard lacks tensor {missing[0]!r}; re-save it")
    return local
