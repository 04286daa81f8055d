"""torch.distributed internals a distributed artifact needs.

Each concern is tied to how torch 2.11-2.14 build and trace DTensor models:

- ``compile_on_one_rank`` (``torch.compiler.config`` from torch 2.14, where the
  ``torch.distributed.config`` name is a deprecated alias; only the latter
  before), under which tracing
  leaves the rank out of the graph (coordinates computed at run time, process
  groups reached through the DeviceMesh), and the DeviceMesh that such a
  graph keeps as an Inductor opaque constant, which PyTorch's serialization
  does not hand back at load (:func:`opaque_meshes_bound` does);
- the forward hooks ``parallelize_module`` registers (``distribute_module``'s
  lambdas around a ``ParallelStyle``'s input/output functions): read from a
  live module at save, registered again on the stand-in at load, under the
  same hook ids (Dynamo's guard tree checks the hook dicts' keys);
- the process-group names a DeviceMesh holds (the compiled collectives
  address their group by name, e.g. ``all_reduce(t, "sum", "0")``);
- one mesh object per model: DTensor's sharding cache hands a mesh equal to
  another out in its place (:func:`rebind_meshes`);
- a DTensor made from a rank's shard without ``DTensor.from_local``, whose
  ``autograd.Function`` (and ``DTensor.__init__``) import Dynamo on first use
  (:func:`dtensor_of_shard`), and made a parameter without dispatching
  ``detach`` through DTensor (:func:`dtensor_parameter`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from ..lean import bound_mesh, current_mesh

# The lambdas distribute_module wraps around a style's input/output functions,
# and the ones PrepareModuleInput/Output register around a bound method.
_DISTRIBUTE_MODULE_HOOK = "distribute_module.<locals>.<lambda>"
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


# Where ``compile_on_one_rank`` lives, newest first: torch 2.14 moved it to
# ``torch.compiler.config`` and kept the old name as a deprecated alias.
ONE_RANK_CONFIGS = ("torch.compiler.config", "torch.distributed.config")


def _one_rank_config() -> Any:
    for name in ONE_RANK_CONFIGS:
        try:
            config = importlib.import_module(name)
        except ImportError:
            continue
        if "compile_on_one_rank" in getattr(config, "_config", {}):
            return config
    return None


def dtensor_of_shard(
    local: torch.Tensor,
    mesh: Any,
    placements: list[Any],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> Any:
    """The DTensor ``from_local(local, mesh, placements, shape=, stride=, run_check=False)``
    returns, made as its ``autograd.Function`` makes it, without the Function.

    ``from_local`` goes through ``autograd.Function.apply`` and ``DTensor(...)``
    through ``DTensor.__init__``, both wrapped by ``torch._disable_dynamo``, whose
    first call imports ``torch._dynamo`` (0.5 s on a 2-core CPU). A load builds
    its weights' DTensors here and imports no compiler. The DTensor does not
    require grad unless ``local`` does, and is a view of ``local`` (as there).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    # DTensor.__new__ is the constructor proper; __init__ only wraps a no-op.
    return DTensor.__new__(DTensor, local.view_as(local), spec, requires_grad=local.requires_grad)


def dtensor_parameter(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``torch.nn.Parameter(tensor, requires_grad)``; for a DTensor, what Parameter makes of
    it (``detach()``, ``requires_grad_``, ``_is_param``) without dispatching ``detach``
    through DTensor, whose first sharding propagation imports Dynamo."""
    from torch.distributed.tensor import DTensor

    if type(tensor) is not DTensor:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    local = tensor._local_tensor.detach()
    param = DTensor.__new__(DTensor, local, tensor._spec, requires_grad=requires_grad)
    param._is_param = True
    return param


def compile_on_one_rank_available() -> bool:
    """Whether this torch has the ``compile_on_one_rank`` config."""
    return _one_rank_config() is not None


@contextlib.contextmanager
def compile_on_one_rank() -> Iterator[None]:
    """Trace with ``compile_on_one_rank`` on: DTensor then computes a rank's mesh
    coordinate at run time (an op of the graph) instead of baking in the
    tracing rank's, and reaches process groups through the DeviceMesh."""
    config = _one_rank_config()
    if config is None:
        raise RuntimeError(f"this torch has no compile_on_one_rank (in {ONE_RANK_CONFIGS})")
    with config.patch(compile_on_one_rank=True):
        yield


def submeshes_at_run_time() -> bool:
    """Whether a graph traced under ``compile_on_one_rank`` derives a submesh (a 2-D
    mesh's ``tp``) from its mesh at run time (``device_mesh::_get_submesh``, torch
    2.13 on). Without it (torch 2.11) the graph names the compiling rank's
    submesh group, which the ranks of another ``dp`` group do not have."""
    importlib.import_module("torch.distributed.tensor")  # registers DeviceMesh's op type
    importlib.import_module("torch.distributed._ops.device_mesh")
    return hasattr(torch.ops.device_mesh, "_get_submesh")


def mesh_group_names(mesh: Any) -> list[str]:
    """The c10d group name of each mesh dimension (what compiled collectives name)."""
    return list(mesh._dim_group_names)


def _closure(fn: Any) -> dict[str, Any]:
    cells = getattr(fn, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def parallel_hooks(module: torch.nn.Module) -> tuple[dict[str, Any], list[str]]:
    """The parallelisation hooks of every submodule, in a picklable form.

    Returns ``({fqn: {"input_fn", "output_fn", "pre_ids", "post_ids", "mesh_dims"}},
    unknown)``: ``input_fn``/``output_fn`` are the ``functools.partial`` of a
    ParallelStyle's static method that ``distribute_module`` registered (None
    when absent), the ids are the hook dicts' keys, ``mesh_dims`` the
    dimension names of the hooks' mesh (``("tp",)`` for a submesh of a 2-D
    mesh). ``unknown`` names hooks of any other origin, which a stand-in
    cannot carry.
    """
    from torch.distributed.device_mesh import DeviceMesh

    records: dict[str, Any] = {}
    unknown: list[str] = []
    for fqn, mod in module.named_modules():
        entry: dict[str, Any] = {
            "input_fn": None,
            "output_fn": None,
            "pre_ids": [],
            "post_ids": [],
            "mesh_dims": None,
        }
        for attr, fn_key, ids_key in (
            ("_forward_pre_hooks", "input_fn", "pre_ids"),
            ("_forward_hooks", "output_fn", "post_ids"),
        ):
            for hook_id, hook in getattr(mod, attr).items():
                cells = _closure(hook)
                fn = cells.get(fn_key)
                if (
                    getattr(hook, "__qualname__", "") != _DISTRIBUTE_MODULE_HOOK
                    or not isinstance(fn, functools.partial)
                    or entry[fn_key] is not None
                ):
                    unknown.append(f"{fqn or '<root>'}.{attr}[{hook_id}] ({hook!r})")
                    continue
                entry[fn_key] = fn
                entry[ids_key].append(hook_id)
                mesh = cells.get("device_mesh")
                if isinstance(mesh, DeviceMesh) and mesh.mesh_dim_names:
                    entry["mesh_dims"] = tuple(mesh.mesh_dim_names)
        if entry["pre_ids"] or entry["post_ids"]:
            records[fqn] = entry
    return records, unknown


def restore_parallel_hooks(standin: torch.nn.Module, records: dict[str, Any], mesh: Any) -> None:
    """Register the recorded hooks on the stand-in, as ``distribute_module`` did,
    and give them the recorded hook ids."""
    from torch.distributed.tensor import distribute_module

    submeshes: dict[tuple[str, ...], Any] = {}  # one object per submesh (the guards ask `is`)
    for fqn, entry in records.items():
        sub = standin.get_submodule(fqn)
        dims = entry.get("mesh_dims")  # absent: a file from before 2-D meshes
        on = mesh
        if _sliced(mesh, dims):
            if dims not in submeshes:
                submeshes[dims] = mesh[dims[0] if len(dims) == 1 else dims]
            on = submeshes[dims]
        # The stand-in carries the flag as a plain attribute; distribute_module
        # refuses a module flagged as already distributed.
        sub.__dict__.pop("_distribute_module_applied", None)
        distribute_module(
            sub,
            on,
            partition_fn=lambda name, mod, mesh: None,  # parameters are DTensors already
            input_fn=entry["input_fn"],
            output_fn=entry["output_fn"],
        )
        for attr, key in (("_forward_pre_hooks", "pre_ids"), ("_forward_hooks", "post_ids")):
            hooks = getattr(sub, attr)
            items = list(hooks.values())
            hooks.clear()
            for hook_id, hook in zip(entry[key], items):
                hooks[hook_id] = hook


def _sliced(mesh: Any, dims: tuple[str, ...] | None) -> bool:
    """Whether hooks recorded on a mesh of dimensions ``dims`` sit on a submesh of ``mesh``."""
    names = tuple(mesh.mesh_dim_names or ())
    return bool(dims) and dims != names and all(d in names for d in dims)


def _parallel_hook_cells(module: torch.nn.Module) -> Iterator[Any]:
    """The closure cells of every ``distribute_module`` hook of ``module`` and its submodules."""
    for mod in module.modules():
        for attr in _HOOK_DICTS:
            for hook in getattr(mod, attr).values():
                if getattr(hook, "__qualname__", "") == _DISTRIBUTE_MODULE_HOOK:
                    yield from hook.__closure__ or ()


def hook_mesh(module: torch.nn.Module) -> Any:
    """The DeviceMesh ``parallelize_module`` gave ``module``'s hooks (None: no such hook)."""
    from torch.distributed.device_mesh import DeviceMesh

    for cell in _parallel_hook_cells(module):
        if isinstance(cell.cell_contents, DeviceMesh):
            return cell.cell_contents
    return None


def rebind_meshes(module: torch.nn.Module, mesh: Any) -> int:
    """Make ``module``'s DTensors and parallelisation hooks hold ``mesh`` itself wherever
    they hold a mesh equal to it; returns how many were rebound.

    DTensor's sharding propagator caches each op's decision under the mesh's
    *equality* and a cache hit hands back the mesh object it first saw: so in
    a process with two equal meshes (the job's own and the one a load made),
    ``nn.Parameter(dtensor)`` (a ``detach``) on one yields a parameter on the
    other. The compiled code's guards require the parameters' and the hooks'
    mesh to be one object (``hook mesh is weight.device_mesh``); equal meshes
    name the same ranks, layout and device, so the rebinding changes no result.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    rebound = 0
    for mod in module.modules():
        for t in (*mod._parameters.values(), *mod._buffers.values()):
            if isinstance(t, DTensor) and t._spec.mesh is not mesh and t._spec.mesh == mesh:
                spec = copy.copy(t._spec)  # the old spec may be a cache entry: not mutated
                spec.mesh = mesh
                t._spec = spec
                rebound += 1
    for cell in _parallel_hook_cells(module):
        value = cell.cell_contents
        if isinstance(value, DeviceMesh) and value is not mesh and value == mesh:
            cell.cell_contents = mesh
            rebound += 1
    return rebound


@contextlib.contextmanager
def opaque_meshes_bound(mesh: Any) -> Iterator[None]:
    """While compiled graphs are loaded, give their DeviceMesh constants ``mesh``.

    Under ``compile_on_one_rank`` the graph reaches its process groups through
    the DeviceMesh, which Inductor keeps as an opaque constant of the wrapper
    module (``_opaque_obj0``). The lean loader sets the constant from
    :func:`.lean.bound_mesh`; PyTorch's full path, see :func:`full_path_meshes`.
    """
    # The runtime ops the graph calls (``device_mesh._runtime_compute_coordinate_on_dim``,
    # ...) are registered when this module is imported, which nothing else does at load.
    importlib.import_module("torch.distributed._ops.device_mesh")
    with bound_mesh(mesh):
        yield


@contextlib.contextmanager
def full_path_meshes() -> Iterator[None]:
    """PyTorch's deserialization of a graph holding a DeviceMesh, under
    :func:`opaque_meshes_bound`: hand it the bound mesh.

    PyTorch's cache serialization keeps the object in ``torchbind_constants``
    but does not hand it to the reloaded module (there it is None); this hands
    the live mesh of this rank instead. Nothing is patched outside a distributed
    load (importing Inductor's output code is the full path's cost only).
    """
    mesh = current_mesh()
    if mesh is None:
        yield
        return
    from torch._inductor import output_code
    from torch.distributed.device_mesh import DeviceMesh

    classes = (output_code.CompiledFxGraphConstants, output_code.CompiledFxGraphConstantsWithGm)
    originals = {cls: cls.__dict__["unwrap"] for cls in classes if "unwrap" in cls.__dict__}

    def patched(original: Any) -> Any:
        @functools.wraps(original)
        def unwrap(self: Any, g: Any) -> Any:
            attrs = dict(original(self, g))
            for name, value in (getattr(g, "torchbind_constants", None) or {}).items():
                real = getattr(value, "real_obj", value)
                if isinstance(real, DeviceMesh):
                    attrs[name] = mesh
            return attrs

        return unwrap

    for cls, original in originals.items():
        cls.unwrap = patched(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.unwrap = original
