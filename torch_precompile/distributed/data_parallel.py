"""Sharded data parallel that compiles: parameters sharded across ranks, gathered in the graph.

FSDP2 (``fully_shard``) runs its hooks under ``torch._dynamo.disable`` (torch
2.11-2.14), so no single graph of an FSDP2 model exists. :func:`shard_parameters`
shards a model the way torchtitan's SimpleFSDP does: each parameter becomes a
DTensor placed ``Shard(0)`` on a 1-D mesh, and a parametrization gathers it
(all-gather to ``Replicate()``) each time the forward reads it. Dynamo traces
the gather like any DTensor op, so the model compiles to one graph under
``compile_on_one_rank`` and saves as one code file plus a shard file per rank.
In the backward the gathered parameter's gradient is a ``Partial`` mean
across ranks, which DTensor turns into a reduce-scatter: each rank's
parameter receives its own ``Shard(0)`` slice of the reduced gradient, and an
optimizer over the model's parameters updates the local shards only.

On a 2-D mesh (``("dp", "tp")``), :func:`replicate_parameters` composes data
parallel with tensor parallel: a model parallelised over the ``tp`` submesh
keeps its tensor-parallel shards, replicated over ``dp``; its gradients are
averaged over ``dp`` (an all-reduce in the compiled backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class GatherShards(nn.Module):
    """The parametrization :func:`shard_parameters` registers on each parameter.

    Its forward all-gathers the sharded parameter into a plain replicated
    tensor whose gradient is averaged across ranks and scattered back to the
    shards. It holds no mesh: the parameter's own
    DTensor carries it, so the traced graph reaches the process group through
    the parameter.
    """

    def forward(self, shard: Any) -> torch.Tensor:
        from torch.distributed.tensor import Partial, Replicate

        ndim = shard.device_mesh.ndim
        full = shard.redistribute(placements=[Replicate()] * ndim)
        return full.to_local(grad_placements=[Partial("avg")] * ndim)


def shard_parameters(model: nn.Module, mesh: Any) -> nn.Module:
    """Shard every parameter of ``model`` across ``mesh`` (1-D) along its first dimension.

    Each parameter is replaced by a DTensor placed ``Shard(0)`` (this rank keeps
    its slice) and gathered whenever the forward reads it; gradients come back
    averaged across ranks (the data-parallel mean over the ranks' batches) and
    sharded like the parameters. A collective: every rank calls it, and rank
    0's values are scattered (the ranks start equal). Every rank then runs the
    same forward, each on its own batch. Returns ``model``, sharded in place;
    compile it with ``Precompile.compile`` on one rank, save it there, and
    :func:`~torch_precompile.save_shard` it on the others, as a tensor-parallel
    model.
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.nn.utils import parametrize

    if mesh.ndim != 1:
        raise ValueError(
            f"shard_parameters() takes a 1-D device mesh (got {mesh.ndim}-D, shape "
            f"{tuple(mesh.shape)}); slice the data-parallel dimension, e.g. mesh['dp']"
        )
    for fqn, mod in list(model.named_modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            where = f"{fqn}.{name}" if fqn else name
            if isinstance(p, DTensor):
                raise ValueError(f"parameter {where!r} is a DTensor already (sharded twice?)")
            if p.dim() == 0 or p.shape[0] % mesh.size():
                raise ValueError(
                    f"parameter {where!r} of shape {list(p.shape)} cannot be split evenly over "
                    f"{mesh.size()} ranks along its first dimension: the compiled code is the "
                    "same for every rank, so every rank's shard must have the same shape; "
                    "pad or resize it, or keep it out of the model"
                )
            sharded = nn.Parameter(
                distribute_tensor(p.detach(), mesh, [Shard(0)]), requires_grad=p.requires_grad
            )
            mod.register_parameter(name, sharded)
            parametrize.register_parametrization(mod, name, GatherShards(), unsafe=True)
    return model


class ReplicateOverDP(nn.Module):
    """The parametrization :func:`replicate_parameters` registers on each parameter.

    The parameter is a DTensor on the 2-D mesh, ``Replicate()`` over the
    data-parallel dimension and, over the tensor-parallel one, the placement
    ``parallelize_module`` gave it (``Replicate()`` for a parameter it left
    plain). The forward hands the model what it held before: the local tensor
    as a DTensor on the tensor-parallel submesh, or a plain tensor. Its
    gradient is a ``Partial`` mean over ``dp``, which the identity
    redistribute's backward all-reduces. It holds no mesh, only the
    submesh's dimension name: the parameter's DTensor carries the mesh.
    """

    def __init__(self, tp_dim: str | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim  # None: the parameter was plain

    def forward(self, param: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial

        placements = list(param.placements)
        dp = [Partial("avg") if p.is_replicate() else p for p in placements[:-1]]
        local = param.redistribute(placements=placements).to_local(
            grad_placements=[*dp, placements[-1]]
        )
        if self.tp_dim is None:
            return local
        return DTensor.from_local(
            local, param.device_mesh[self.tp_dim], [placements[-1]], run_check=False
        )


def replicate_parameters(model: nn.Module, mesh: Any) -> nn.Module:
    """Data parallel over a 2-D ``mesh`` (``("dp", "tp")``) for a model parallelised over
    ``mesh["tp"]`` (or not at all).

    Each parameter becomes a DTensor on ``mesh``: replicated over ``dp``, placed
    over ``tp`` as ``parallelize_module`` placed it (a plain parameter:
    replicated). The forward reads it as before (the tensor-parallel DTensor
    or the plain tensor), so the parallelisation hooks are unchanged; in the
    backward its gradient is averaged over ``dp`` (every ``dp`` group member ran
    its own batch) and lands on the parameter as a DTensor on ``mesh``, the
    tensor-parallel shard of the mean gradient. Not a collective (the ranks of
    a ``dp`` group start equal, as data parallel requires). Returns ``model``,
    changed in place; compile it on one rank and save it as any
    tensor-parallel model.
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.nn.utils import parametrize

    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or len(names) != 2:
        raise ValueError(
            "replicate_parameters() takes a 2-D device mesh with named dimensions "
            f"(data parallel, then tensor parallel; got shape {tuple(mesh.shape)}, names "
            f"{list(names)}); build it with init_device_mesh(device, (dp, tp), "
            'mesh_dim_names=("dp", "tp"))'
        )
    tp_dim = names[1]
    for fqn, mod in list(model.named_modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            where = f"{fqn}.{name}" if fqn else name
            if isinstance(p, DTensor):
                sub = p.device_mesh
                if tuple(sub.mesh_dim_names or ()) != (tp_dim,) or sub != mesh[tp_dim]:
                    raise ValueError(
                        f"parameter {where!r} is a DTensor on {sub}, not on mesh[{tp_dim!r}]; "
                        f"parallelise the model over mesh[{tp_dim!r}] first"
                    )
                placement, local = p.placements[0], p.to_local()
                fn = ReplicateOverDP(tp_dim)
            else:
                placement, local = Replicate(), p.detach()
                fn = ReplicateOverDP(None)
            param = nn.Parameter(
                DTensor.from_local(local, mesh, [Replicate(), placement], run_check=False),
                requires_grad=p.requires_grad,
            )
            mod.register_parameter(name, param)
            parametrize.register_parametrization(mod, name, fn, unsafe=True)
    return model
