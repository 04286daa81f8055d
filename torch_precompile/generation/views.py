"""Views of a model the generator's step is traced through; the model itself is unchanged.

:func:`own_copy` copies one module shallowly (its submodules and weights
shared); :func:`fused_projections` rewrites a view so projections that read
the same input (an attention's ``q_proj``, ``k_proj`` and ``v_proj``; a gated
MLP's ``gate_proj`` and ``up_proj``) are one matrix: each part computes the
whole product and keeps its slice, and the step's graph, rid of duplicates
(``_compat.without_duplicates``), computes it once. At batch 1 a decode step
is a few microseconds a kernel; one matmul instead of three (and of two) is
three fewer kernels a layer, each reading its weights once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

__all__ = ["FusedPart", "fused_projections", "own_copy"]

# Children of one module that read the same input, in the order they are joined.
_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def own_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module sharing ``module``'s submodules and attributes, with its own dicts (of
    parameters, buffers, hooks): a dict shared by two modules would be guarded on as one
    object, which the module a file rebuilds at load does not repeat."""
    view = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set, list)):
            vars(view)[key] = copy.copy(value)
    return view


class FusedPart(torch.nn.Module):
    """One projection of a fused group: the group's product, columns ``start:stop``.

    ``weight`` and ``bias`` are the group's joined tensors, the same objects in
    every part (tied, so a file holds them once); ``in_features`` and
    ``out_features`` are the projection's own, as the ``nn.Linear`` it stands for.
    """

    def __init__(
        self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, start: int, stop: int
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.start, self.stop = start, stop
        self.in_features, self.out_features = weight.shape[1], stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)[..., self.start : self.stop]


def _fusable(linears: list[torch.nn.Module]) -> bool:
    """Plain ``nn.Linear`` modules over one input size, dtype and device, all with a bias
    or none, no hooks, no tensor subclass (a sharded or quantised weight is left alone)."""
    if not all(type(m) is torch.nn.Linear for m in linears):
        return False
    first = linears[0].weight
    return all(
        type(m.weight) is torch.nn.Parameter
        and m.weight.shape[1] == first.shape[1]
        and m.weight.dtype == first.dtype
        and m.weight.device == first.device
        and (m.bias is None) == (linears[0].bias is None)
        and not (m._forward_hooks or m._forward_pre_hooks)
        for m in linears
    )


def _joined(tensors: list[torch.Tensor]) -> torch.nn.Parameter:
    with torch.no_grad():
        return torch.nn.Parameter(torch.cat(tensors), requires_grad=tensors[0].requires_grad)


def fused_projections(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """A view of ``model`` whose groups of projections are fused, and how many groups.

    Only the modules on the way to a fused group are copied (:func:`own_copy`);
    the rest, and every other weight, is shared with ``model``. The joined
    weights are new tensors: the build holds the fused projections' weights
    twice (the model's and the view's) while it runs.
    """
    groups = []
    for path, module in model.named_modules():
        for names in _GROUPS:
            linears = [module._modules.get(n) for n in names]
            if all(m is not None for m in linears) and _fusable(linears):  # type: ignore[arg-type]
                groups.append((path, names, linears))
    if not groups:
        return model, 0
    view, copied = copy_on_paths(model)

    for path, names, linears in groups:
        owner = copied(path)
        weight = _joined([m.weight for m in linears])
        bias = None if linears[0].bias is None else _joined([m.bias for m in linears])
        start = 0
        for name, linear in zip(names, linears):
            stop = start + linear.weight.shape[0]
            owner._modules[name] = FusedPart(weight, bias, start, stop)
            start = stop
    return view, len(groups)


def copy_on_paths(
    model: torch.nn.Module,
) -> tuple[torch.nn.Module, Callable[[str], torch.nn.Module]]:
    """A view of ``model`` (:func:`own_copy`) and ``copied(path)``: the view's submodule at
    ``path``, each module on the way copied once, so the view's changes there leave the
    model's own modules as they are."""
    view = own_copy(model)
    copies: dict[str, torch.nn.Module] = {"": view}

    def copied(path: str) -> torch.nn.Module:
        if path not in copies:
            parent_path, _, name = path.rpartition(".")
            parent = copied(parent_path)
            parent._modules[name] = own_copy(parent._modules[name])  # type: ignore[arg-type]
            copies[path] = parent._modules[name]  # type: ignore[assignment]
        return copies[path]

    return view, copied
