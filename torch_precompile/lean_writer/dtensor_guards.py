"""Lean guards for tensor parallelism, at save: Dynamo's DTensor and DeviceMesh
guards as plain data.

Dynamo guards each DTensor it reads with a lambda (``DTENSOR_SPEC_MATCH``:
``spec._check_equals(saved, skip_shapes=True)``: mesh, placements, shard
order and dtype), a DeviceMesh held by a parallelisation hook with a lambda
over its ``guard_fn`` (``OPAQUE_OBJ_GUARD_FN_MATCH``: what mesh equality
compares) and a type check (``FAKE_SCRIPT_TYPE_MATCH``; torch 2.11 instead
compares the mesh with the saved one, a C++ ``EQUALS_MATCH`` leaf: the same class,
then ``DeviceMesh.__eq__``, which compares the same), and a ParallelStyle's
layouts with equalities to placements (``== Shard(dim=-1)``). The lean
guards cannot read a lambda back, but the saved model's values are at hand at
save: the same comparisons are recorded as data, and
:class:`.lean.subclasses.DTensorSpecCheck` and :class:`.lean.subclasses.MeshCheck`
run them at load. Each reader joins ``guard_leaves``' registries by the
guard's builder (lambdas), the leaf's type or the compared object's class
(equalities), never by its text.
"""

from __future__ import annotations

from typing import Any

from ..lean.guard_schema import DTensorSpecRecord
from ..lean.subclasses import mesh_layout
from .guard_leaves import (
    LeafNode,
    NoLeanGuards,
    equals_reader,
    lambda_reader,
    leaf_reader,
    qualified_name,
)

_MESH = "torch.distributed.device_mesh.DeviceMesh"


def mesh_descriptor(mesh: Any) -> list[Any]:
    """What DeviceMesh equality compares (its ranks and layout, device type,
    dimension names and thread), as plain data for ``lean.subclasses.MeshCheck``:
    ``DeviceMesh.__eq__`` compares the flattened rank map and the layout (a
    submesh and a fresh mesh over the same ranks differ there)."""
    return [
        mesh.device_type,
        mesh.mesh.tolist(),
        list(mesh.mesh_dim_names or ()),
        getattr(mesh, "_thread_id", None),
        *mesh_layout(mesh),
    ]


@lambda_reader("DTENSOR_SPEC_MATCH")
def _dtensor_spec(node: LeafNode, guard: Any, reader: Any) -> list[list[Any]]:
    value = node.need_value()  # the saved model's DTensorSpec
    if type(value).__name__ != "DTensorSpec":
        raise NoLeanGuards(f"{node.name}: a DTensor spec guard on a {type(value).__name__}")
    meta = value.tensor_meta
    return [
        [
            "dtensor_spec",
            DTensorSpecRecord(
                placements=repr(tuple(value.placements)),
                shard_order=repr(value.shard_order),
                dtype=None if meta is None else str(meta.dtype),
                mesh=mesh_descriptor(value.mesh),
            ).write(),
        ]
    ]


@lambda_reader("OPAQUE_OBJ_GUARD_FN_MATCH")
def _mesh_guard_fn(node: LeafNode, guard: Any, reader: Any) -> list[list[Any]]:
    value = node.need_value()
    if qualified_name(value) != _MESH:  # another opaque object: its guard_fn is unknown
        raise NoLeanGuards(f"{node.name}: an opaque {qualified_name(value)}")
    return [["mesh", mesh_descriptor(value)]]


@equals_reader(_MESH)
def _mesh_equals(node: LeafNode, value: Any) -> list[list[Any]]:
    # torch 2.11: the mesh is a constant to Dynamo (not yet an opaque object).
    cls = type(value)
    return [["class", cls.__module__, cls.__qualname__], ["mesh", mesh_descriptor(value)]]


@leaf_reader("FAKE_SCRIPT_TYPE_MATCH")
def _mesh_type(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    value = node.need_value()
    if n != 1 or qualified_name(value) != _MESH:
        raise NoLeanGuards(f"{node.name}: a script-object type check on {qualified_name(value)}")
    cls = type(value)
    return [["class", cls.__module__, cls.__qualname__]]
