"""Light guards for tensor parallelism, at save: Dynamo's DTensor and DeviceMesh
guards as plain data.

Dynamo guards each DTensor it reads with a lambda (``DTENSOR_SPEC_MATCH``:
``spec._check_equals(saved, skip_shapes=True)``: mesh, placements, shard
order and dtype), a DeviceMesh held by a parallelisation hook with a lambda
over its ``guard_fn`` (what mesh equality compares) and a type check
(``FAKE_SCRIPT_TYPE_MATCH``), and a ParallelStyle's layouts with equalities
to placements (``== Shard(dim=-1)``). The light guards cannot read a lambda
back, but the saved model's values are at hand at save: the same comparisons
are recorded as data, and :class:`.lean.subclasses.DTensorSpecCheck` and
:class:`.lean.subclasses.MeshCheck` run them at load. :func:`dtensor_leaf` is the one entry
point (called by ``light_guard_spec``).
"""

from __future__ import annotations

from typing import Any

DTENSOR_SPEC_GUARD = "__dtensor_spec_"  # how Dynamo names the guard's lambda in its code part


def dtensor_spec_leaf(text: str, value: Any, has_value: bool) -> list[Any] | None:
    """The light leaf of Dynamo's DTensor spec guard ``text`` on ``value`` (the saved
    model's ``DTensorSpec``), or None when ``text`` is another guard or the spec
    is not at hand."""
    if not text.startswith(DTENSOR_SPEC_GUARD) or not has_value:
        return None
    if type(value).__name__ != "DTensorSpec":
        return None
    mesh, meta = value.mesh, value.tensor_meta
    return [
        "dtensor_spec",
        {
            "placements": repr(tuple(value.placements)),
            "shard_order": repr(value.shard_order),
            "dtype": None if meta is None else str(meta.dtype),
            "mesh": mesh_descriptor(mesh),
        },
    ]


def mesh_descriptor(mesh: Any) -> list[Any]:
    """What DeviceMesh equality compares (its ranks and layout, device type,
    dimension names and thread), as plain data for ``lean.subclasses.MeshCheck``."""
    return [
        mesh.device_type,
        mesh.mesh.tolist(),
        list(mesh.mesh_dim_names or ()),
        getattr(mesh, "_thread_id", None),
    ]


OPAQUE_GUARD = "___check_opaque_guard_fn_"  # Dynamo's lambda over an opaque object's guard_fn


def mesh_guard_leaf(text: str, value: Any, has_value: bool) -> list[Any] | None:
    """The light leaf of Dynamo's opaque-object guard on a DeviceMesh (its
    ``guard_fn``: rank map, layout, device type, dimension names, thread: what
    mesh equality compares), or None for any other guard."""
    if not text.startswith(OPAQUE_GUARD) or not has_value:
        return None
    cls = type(value)
    if f"{cls.__module__}.{cls.__qualname__}" != "torch.distributed.device_mesh.DeviceMesh":
        return None
    return ["mesh", mesh_descriptor(value)]


def placement_equals_leaf(text: str, value: Any, has_value: bool) -> list[Any] | None:
    """The light leaf of an equality with a DTensor placement (``... == Shard(dim=-1)``,
    a ParallelStyle's layout read by its hook), or None for any other equality."""
    if not has_value or type(value).__module__ != "torch.distributed.tensor.placement_types":
        return None
    if not text.endswith(f" == {value!r}"):
        return None
    return ["equals", value]  # the placement itself: compared by type and ==


def mesh_type_leaf(kind: str, text: str, value: Any, has_value: bool) -> list[Any] | None:
    """The light leaf of Dynamo's type check of an opaque DeviceMesh
    (``FAKE_SCRIPT_TYPE_MATCH``, ``type=<class '...DeviceMesh'>``): its class by
    name, as a TYPE_MATCH; None for anything else."""
    if kind != "FAKE_SCRIPT_TYPE_MATCH" or not has_value:
        return None
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name != "torch.distributed.device_mesh.DeviceMesh" or f"type=<class '{name}'>" not in text:
        return None
    return ["class", cls.__module__, cls.__qualname__]


def dtensor_leaf(kind: str, text: str, value: Any, has_value: bool) -> list[Any] | None:
    """The light leaf of one of Dynamo's tensor-parallel guards (``kind``: the leaf's
    class name, ``text``: its code part, ``value``: the saved model's value), or
    None when it is none of them."""
    if kind == "LAMBDA_GUARD":
        return dtensor_spec_leaf(text, value, has_value) or mesh_guard_leaf(text, value, has_value)
    if kind == "EQUALS_MATCH":
        return placement_equals_leaf(text, value, has_value)
    return mesh_type_leaf(kind, text, value, has_value)
