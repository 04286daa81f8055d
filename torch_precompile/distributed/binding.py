"""Load: the job's layout checked against the file's, the rank's live mesh bound to
the compiled code, and the stand-in module rebuilt from the rank's shard."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._compat import distributed as _cdist
from .._errors import DistributedLayoutError
from ..file.extension import FileExtension
from ..file.sections import DISTRIBUTED_HOOKS
from ..lean.standin import module as _standin
from .placement import (
    Layout,
    _dist,
    _mesh_info,
    _mesh_key,
    _sharded,
    decode_placement,
    encode_placement,
)
from .shards import _local_device, read_shard

if TYPE_CHECKING:
    from ..file.opened import OpenedFile, Sections


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
        if mesh is not None:  # one mesh object in the model
            _cdist.rebind_meshes(model, mesh)
    return layout


def _model_mesh(model: Any) -> Any:
    """The mesh of a live parallelised model: the one its parallelisation hooks were
    given (the job's own), else its first DTensor's; None for a plain model."""
    sharded = _sharded(model) if isinstance(model, torch.nn.Module) else {}
    if not sharded:
        return None
    mesh = next(iter(sharded.values())).device_mesh
    hooks = _cdist.hook_mesh(model)  # on a 2-D mesh, the hooks hold a submesh
    return hooks if hooks is not None and hooks == mesh else mesh


def _check_model(layout: Layout, model: Any, path: str) -> None:
    if not isinstance(model, torch.nn.Module):
        return  # the binding itself reports a wrong model=
    sharded = _sharded(model)
    fix = (
        "parallelise the model as it was when the artifact was compiled (same mesh and "
        "parallelize_module plan, shard_parameters or replicate_parameters), or compile and "
        "save again"
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


def mesh_for(layout: Layout, model: Any, mesh: Any, path: str) -> Any:
    """The mesh this rank runs the artifact on: the live model's (``model=``), else the
    one passed (``mesh=``, checked against the saved one), else a new one of the
    saved shape (``init_device_mesh``; a 1-D mesh over the world reuses the world's
    process group, a mesh of more dimensions makes its groups anew)."""
    live = _model_mesh(model)
    if live is not None:
        return live
    if mesh is not None:
        given = _mesh_info(mesh)
        if _mesh_key(given) != _mesh_key(layout.mesh):
            raise DistributedLayoutError(
                f"{path}",
                layout.mesh.describe(),
                f"{given.describe()} (mesh=)",
                "pass a mesh of the saved shape and dimension names (init_device_mesh("
                f"{layout.mesh.device_type!r}, {layout.mesh.shape}, mesh_dim_names="
                f"{layout.mesh.dim_names})), or compile and save again on this job's mesh",
            )
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            layout.mesh.device_type, layout.mesh.shape, mesh_dim_names=layout.mesh.dim_names
        )
    current = _mesh_info(mesh)
    if current.group_names != layout.mesh.group_names:
        raise DistributedLayoutError(
            f"{path}: the mesh's process groups",
            f"groups named {list(layout.mesh.group_names)}",
            f"groups named {list(current.group_names)}",
            "the compiled collectives address their process group by name: pass mesh= a "
            "mesh built as in the compiling job (init_device_mesh over the whole world, "
            "before any other new_group), or load with model= bound to one",
        )
    return mesh


def build_standin(
    path: str,
    layout: Layout,
    mesh: Any,
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    sections: Sections,
) -> torch.nn.Module:
    """The stand-in model of this rank: plain tensors from the code file, DTensors
    from the rank's own shard file on ``mesh``, the parallelisation hooks again."""
    rank = torch.distributed.get_rank()
    local = read_shard(path, layout, rank)
    device = _local_device(layout.mesh.device_type)
    # One placement object per placement, as DTensor's sharding cache hands them out to
    # a live model's parameters: the guards compare them by identity across parameters.
    placements: dict[str, Any] = {}
    for name, spec in layout.tensors.items():
        tensors[name] = _cdist.dtensor_of_shard(
            local[name].to(device),
            mesh,
            [placements.setdefault(p, decode_placement(p)) for p in spec.placements],
            torch.Size(spec.shape),
            tuple(spec.stride),
        )
    standin = _standin.build_standin(skeleton, tensors, _cdist.dtensor_parameter)
    hooks = pickle.loads(sections[DISTRIBUTED_HOOKS]) if DISTRIBUTED_HOOKS in sections else {}
    _cdist.restore_parallel_hooks(standin, hooks, mesh)
    _cdist.rebind_meshes(standin, mesh)  # parameters may hold an equal mesh of the job
    return standin


class DistributedFile(FileExtension):
    """A distributed job's code file: checked against this job (world size, mesh, and
    ``model=``'s placements) before anything is read; the weights are this rank's
    shard on this rank's mesh (:func:`mesh_for`: ``model=``'s, ``mesh=``, or a new
    one); a ``compile_on_one_rank`` graph's mesh is bound to the same mesh."""

    def __init__(self, file: OpenedFile, layout: Layout, model: Any, mesh: Any) -> None:
        self.file, self.layout, self.model, self._given = file, layout, model, mesh
        self._mesh: Any = None

    @classmethod
    def for_file(cls, file: OpenedFile, model: Any, mesh: Any) -> DistributedFile | None:
        layout = check_job(file.header.distributed, file.path, model)
        return None if layout is None else cls(file, layout, model, mesh)

    @property
    def mesh(self) -> Any:
        """This load's mesh, made or checked once."""
        if self._mesh is None:
            self._mesh = mesh_for(self.layout, self.model, self._given, self.file.path)
        return self._mesh

    def weights(self, skeleton: dict[str, Any], tensors: dict[str, Any]) -> Any:
        path, sections = self.file.path, self.file.sections
        return build_standin(path, self.layout, self.mesh, skeleton, tensors, sections)

    @contextlib.contextmanager
    def deserializing(self) -> Iterator[None]:
        """A ``compile_on_one_rank`` graph holds a DeviceMesh: bound to this load's."""
        if not self.layout.one_rank:
            yield
            return
        with _cdist.opaque_meshes_bound(self.mesh):
            yield
