"""AOTAutograd's subclass desugaring, lean: DTensor inputs fed to the compiled graph
as their local shards, and DTensor outputs wrapped again.

AOTAutograd compiles a graph of plain tensors for a model whose parameters are
tensor subclasses (DTensor, under tensor parallelism): at run time its wrapper
flattens each subclass input into its inner values (``__tensor_flatten__``'s
attributes: a DTensor's ``_local_tensor`` and its ``device_mesh``, an opaque
object) and rebuilds the subclass outputs from the graph's plain outputs
(``__tensor_unflatten__`` with the metadata recorded at trace time), as
``runtime_unwrap_tensor_subclasses`` and ``wrap_tensor_subclasses`` in
``torch/_functorch/_aot_autograd/subclass_utils.py`` do. This module does the
same from a spec read off AOTAutograd's cache entry at save, for the case of
tensor parallelism: one level of subclass (inner values are plain tensors or
opaque objects), static outer sizes. For training (inside the lean
``autograd.Function``, as AOTAutograd's own does) the forward's activations
after the user's outputs pass through, and each gradient of a DTensor input is
rebuilt as a DTensor (``grad_input_metas``); tangents must be plain tensors.

A graph traced under ``compile_on_one_rank`` also holds the DeviceMesh as a
constant of Inductor's wrapper (``_opaque_obj0``): the loader binds it to this
rank's mesh (:func:`bound_mesh`, entered by the distributed load).
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .guard_schema import DTensorSpecRecord
from .guard_types import named_class
from .schema import SubclassSpec

# The DeviceMesh a distributed load binds to the compiled graph's mesh constants.
_BOUND_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("bound_mesh", default=None)


@contextlib.contextmanager
def bound_mesh(mesh: Any) -> Iterator[None]:
    """While artifacts are loaded, give their graphs' DeviceMesh constants ``mesh``."""
    token = _BOUND_MESH.set(mesh)
    try:
        yield
    finally:
        _BOUND_MESH.reset(token)


def current_mesh() -> Any:
    """The mesh :func:`bound_mesh` holds (None outside it)."""
    return _BOUND_MESH.get()


def mesh_constants(spec: SubclassSpec) -> dict[str, Any]:
    """The wrapper's DeviceMesh constants, bound to this rank's mesh."""
    if not spec.mesh_constants:
        return {}
    mesh = current_mesh()
    if mesh is None:
        raise ValueError("the compiled graph holds a DeviceMesh and no mesh was bound at load")
    return dict.fromkeys(spec.mesh_constants, mesh)


def _wrap(rebuilt: tuple[tuple[Any, ...], ...], flat: Any) -> list[Any]:
    """The model's values from the graph's plain ones, as ``rebuilt`` says."""
    out: list[Any] = []
    for o in rebuilt:
        if len(o) == 1:
            out.append(flat[o[0]])
            continue
        start, module, qualname, attrs, meta, size, stride = o
        if flat[start] is None:  # no gradient for this input
            out.append(None)
            continue
        cls = named_class(module, qualname)
        inner = {name: flat[start + i] for i, name in enumerate(attrs)}
        out.append(cls.__tensor_unflatten__(inner, pickle.loads(meta), size, stride))
    return out


def wrap_gradients(spec: SubclassSpec, flat: Any) -> tuple[Any, ...]:
    """The backward's plain gradients as the graph inputs' (a DTensor's as a DTensor)."""
    return tuple(_wrap(spec.grad_inputs, flat))


def flattening(
    spec: SubclassSpec, call_list: Callable[[list[Any], list[Any] | None], Any]
) -> Callable[[list[Any], list[Any] | None], Any]:
    """``call_list`` (the compiled graph's boxed call) taking the model's graph inputs:
    each subclass input flattened into its inner values, and the subclass outputs
    rebuilt."""
    where = tuple((i, attrs) for i, attrs in enumerate(spec.inputs) if attrs is not None)
    wrap = any(len(o) > 1 for o in spec.outputs)
    users = spec.user_flat_outputs  # training: activations follow the user's outputs

    def call(inputs: list[Any], received: list[Any] | None = None) -> Any:
        flat: list[Any] = []
        last = 0
        for i, attrs in where:
            flat.extend(inputs[last:i])
            x = inputs[i]
            flat.extend(getattr(x, a) for a in attrs)
            last = i + 1
        flat.extend(inputs[last:])
        inputs.clear()
        result = call_list(flat, received)
        if not wrap:
            return result
        if users is None:
            return _wrap(spec.outputs, result)
        return [*_wrap(spec.outputs, result), *result[users:]]

    return call


def mesh_layout(mesh: Any) -> list[Any]:
    """The flattened rank map and the layout (its repr) DeviceMesh equality compares
    besides the ranks, device type, names and thread."""
    rank_map = getattr(mesh, "_flatten_rank_map", None)
    return [
        list(rank_map) if rank_map is not None else None,
        repr(getattr(mesh, "_layout", None)),
    ]


class MeshCheck:
    """A DeviceMesh against ``lean_writer.dtensor_guards.mesh_descriptor`` of the saved one:
    equal as DeviceMesh equality decides (ranks and layout, device type, dimension
    names, thread). The last mesh found equal is remembered (a weak reference),
    so a call with the same mesh costs one identity test."""

    def __init__(self, saved: list[Any]) -> None:
        self._saved = saved
        self._last: weakref.ref[Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # what was saved, not the last mesh seen
        return (type(self), (self._saved,))

    def ok(self, mesh: Any) -> bool:
        if self._last is not None and self._last() is mesh:
            return True
        device_type, ranks, names, thread, *layout = self._saved  # no layout: an older file
        equal = (
            type(mesh).__name__ == "DeviceMesh"
            and mesh.device_type == device_type
            and list(mesh.mesh_dim_names or ()) == names
            and getattr(mesh, "_thread_id", None) == thread
            # The root's ranks and the layout within it, as equality compares: a
            # submesh (a 2-D mesh's "tp") is equal on every rank, its ranks are not.
            and (mesh_layout(mesh) == layout if layout else mesh.mesh.tolist() == ranks)
        )
        if equal:
            self._last = weakref.ref(mesh)
        return equal


class DTensorSpecCheck:
    """Dynamo's DTensor spec guard (``_check_equals(saved, skip_shapes=True)``) against
    the spec recorded at save (``lean_writer.dtensor_guards``' DTENSOR_SPEC_MATCH reader): the mesh,
    placements, shard order and dtype. The last spec found equal is remembered."""

    def __init__(self, saved: dict[str, Any]) -> None:
        self._saved = saved
        self._record = DTensorSpecRecord.read(saved)
        self._mesh = MeshCheck(self._record.mesh)
        self._last: weakref.ref[Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # what was saved, not the last spec seen
        return (type(self), (self._saved,))

    def ok(self, spec: Any) -> bool:
        if self._last is not None and self._last() is spec and self._mesh.ok(spec.mesh):
            return True
        saved, meta = self._record, spec.tensor_meta
        equal = (
            repr(tuple(spec.placements)) == saved.placements
            and repr(spec.shard_order) == saved.shard_order
            and (meta is None if saved.dtype is None else str(meta.dtype) == saved.dtype)
            and self._mesh.ok(spec.mesh)
        )
        if equal:
            self._last = weakref.ref(spec)
        return equal
