"""Lean guards, at precompile: one reader per kind of Dynamo's C++ leaf guards.

Each reader turns the leaves of one type on one node of Dynamo's guard tree
into lean-guard leaves (plain data :mod:`.lean.guards` checks). It is
given the node (its typed source, live value and the kept guards whose leaves
sit on it), how many leaves of its type the node holds, and the tree reader
(Dynamo's CheckFunctionManager and the capture's output graph). The expected
values come from the live value and the guards' arguments, never from a
guard's debug text; a reader refuses (``NoLeanGuards``) what it cannot
express as strictly as Dynamo. A new kind is one more ``@leaf_reader``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._compat import FROM_2_15, kernels_read_thread_count
from ..lean import LEAN_TYPES, named_class
from ..lean.guard_schema import global_state_leaf

MISSING = object()
_TYPE_NAMES = {cls: name for name, cls in LEAN_TYPES.items()}
# Tensor attributes Dynamo's dimension-marking guard reads (a superset of any
# supported torch's list: an attribute named here but not read by Dynamo only
# makes the lean check stricter).
_DIM_MARKING_ATTRS = (
    "_dynamo_dynamic_indices",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_static_indices",
    "_dynamo_shape_ids",
    "_dynamo_unbacked_bounds",
)


class NoLeanGuards(Exception):
    """A guard the lean check cannot express."""


@dataclasses.dataclass
class LeafNode:
    """One node of Dynamo's guard tree being read: its source, live value and guards."""

    name: str
    source: Any  # a Dynamo Source, or None for a node no source names (``__dict__``)
    value: Any  # MISSING when it could not be read
    guards: list[Any]  # the kept guards whose leaves sit on this node
    is_root: bool = False

    def guard_kwargs(self, *kinds: str) -> list[tuple[str, dict[str, Any]]]:
        """(kind, keyword arguments) of this node's guards of the given builder kinds."""
        found = []
        for guard in self.guards:
            kind = guard_kind(guard)
            if kind in kinds:
                found.append((kind, dict(getattr(guard.create_fn, "keywords", None) or {})))
        return found

    def need_value(self) -> Any:
        if self.value is MISSING:
            raise NoLeanGuards(f"no live value for {self.name}")
        return self.value


def guard_kind(guard: Any) -> str:
    """The GuardBuilder method a guard runs (``TENSOR_MATCH``), from its ``create_fn``."""
    fn = guard.create_fn
    fn = getattr(fn, "func", fn)  # functools.partial(GuardBuilder.X, key=...)
    return str(getattr(fn, "__name__", ""))


def qualified_name(value: Any) -> str:
    """The ``module.qualname`` of ``value``'s class."""
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def hasattr_guard(guard: Any) -> tuple[Any, str | None]:
    """The source of the object a HASATTR guard asks about, and the attribute's
    name (None if unknown). torch 2.13 and later guard the object with an
    ``attr=`` argument; torch 2.11 guards the attribute's own ``AttrSource``."""
    from torch._dynamo.source import AttrSource, NNModuleSource

    source = guard.originating_source
    if isinstance(source, NNModuleSource):
        source = source.base
    attr = (getattr(guard.create_fn, "keywords", None) or {}).get("attr")
    if attr is None and isinstance(source, AttrSource):
        return source.base, source.member
    return source, attr if isinstance(attr, str) else None


# --- leaves: one reader per C++ leaf type, given the node and how many there are ---

_Reader = TypeVar("_Reader", bound=Callable[..., list[list[Any]]])


def _registrar(registry: dict[str, Any]) -> Callable[..., Callable[[_Reader], _Reader]]:
    """A decorator factory: ``@register("KIND", ...)`` files a reader under each kind."""

    def register(*kinds: str) -> Callable[[_Reader], _Reader]:
        def add(fn: _Reader) -> _Reader:
            registry.update(dict.fromkeys(kinds, fn))
            return fn

        return add

    return register


_LeafReader = Callable[[LeafNode, int, Any], list[list[Any]]]
LEAF_READERS: dict[str, _LeafReader] = {}
leaf_reader = _registrar(LEAF_READERS)  # readers of C++ leaf guards, by the leaf's type


def _one(n: int, kind: str, node: LeafNode) -> None:
    if n != 1:
        raise NoLeanGuards(f"{n} {kind} leaves on {node.name}")


@leaf_reader("TYPE_MATCH")
def _type_match(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    cls = type(node.need_value())
    if cls in _TYPE_NAMES:
        return [["type", _TYPE_NAMES[cls]]]
    # Another class: checked by identity with the class of that name, which the
    # object's own module (imported, since the object exists) defines.
    if "<locals>" in cls.__qualname__ or named_class(cls.__module__, cls.__qualname__) is not cls:
        raise NoLeanGuards(f"{node.name}: class {cls.__qualname__} cannot be found by its name")
    return [["class", cls.__module__, cls.__qualname__]]


def _literal(value: Any) -> bool:
    """Whether ``value`` is a constant the lean check can hold and compare by ``==``."""
    if type(value) in (int, bool, str, bytes, type(None), torch.device):
        return True
    if type(value) is float:
        return value == value  # NaN: Dynamo guards it otherwise
    if type(value) in (tuple, list, frozenset, set):
        return all(_literal(v) for v in value)
    return False


def _placement(value: Any) -> bool:
    """A DTensor placement (``Shard(dim=-1)``, a ParallelStyle's layout read by its
    hook): held as it is, compared by type and ``==`` at load."""
    return type(value).__module__ == "torch.distributed.tensor.placement_types"


# Readers of equalities with objects other than constants and placements, by the
# object's class (``module.qualname``): what its ``__eq__`` compares, as plain data.
_EqualsReader = Callable[[LeafNode, Any], list[list[Any]]]
EQUALS_READERS: dict[str, _EqualsReader] = {}
equals_reader = _registrar(EQUALS_READERS)


@leaf_reader("EQUALS_MATCH")
def _equals(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    value = node.need_value()
    if _literal(value) or _placement(value):
        return [["equals", value]]
    read = EQUALS_READERS.get(qualified_name(value))
    if read is None:
        raise NoLeanGuards(f"{node.name}: equality with a {type(value).__name__}")
    return read(node, value)


@leaf_reader("NONE_MATCH", "TRUE_MATCH", "FALSE_MATCH")
def _is_constant(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    value = node.need_value()
    if type(value) not in (type(None), bool):
        raise NoLeanGuards(f"{node.name}: identity with a {type(value).__name__}")
    return [["is", value]]


@leaf_reader("LENGTH_CHECK", "DICT_LENGTH")
def _length(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    return [["len", len(node.need_value())]]


@leaf_reader("TENSOR_MATCH")
def _tensor(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    _one(n, "TENSOR_MATCH", node)
    value = node.need_value()
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise NoLeanGuards(f"{node.name}: a {type(value).__name__}")
    sizes_strides = reader.output_graph.input_source_to_sizes_strides
    found = [g for g in node.guards if guard_kind(g) == "TENSOR_MATCH"]
    metadata = sizes_strides.get(found[0].originating_source) if found else None
    if metadata is None:
        raise NoLeanGuards(f"{node.name}: no recorded sizes and strides")
    # None: a dynamic dimension (its range is a shape guard).
    size, stride = (_concrete(metadata["size"]), _concrete(metadata["stride"]))
    if value.device.type == "cpu":
        device = None
    elif value.device.type == "cuda":
        device = value.device.index
    else:
        raise NoLeanGuards(f"{node.name}: device {value.device}")
    # The keys Dynamo's TensorCheck records: the tensor's, under this thread's state.
    keys = (
        torch._C._dispatch_keys(value) | torch._C._dispatch_tls_local_include_set()
    ) - torch._C._dispatch_tls_local_exclude_set()
    cls = "Parameter" if type(value) is torch.nn.Parameter else "Tensor"
    dtype = str(value.dtype).removeprefix("torch.")
    leaf = ["tensor", cls, keys.raw_repr(), dtype, value.requires_grad, size, stride]
    return [[*leaf, device] if device is not None else leaf]


def _concrete(dims: Sequence[Any]) -> list[int | None]:
    out: list[int | None] = []
    for dim in dims:
        if isinstance(dim, torch.SymInt):
            dim = dim.node.maybe_as_int()
        if dim is not None and type(dim) is not int:
            raise NoLeanGuards(f"a dimension of type {type(dim).__name__}")
        out.append(dim)
    return out


@leaf_reader("DIMENSION_DYNAMIC_MARKING_GUARD")
def _dim_marking(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    _one(n, "DIMENSION_DYNAMIC_MARKING_GUARD", node)
    value = node.need_value()
    present = [a for a in _DIM_MARKING_ATTRS if hasattr(value, a)]
    if set(present) - {"_dynamo_dynamic_indices"}:
        raise NoLeanGuards(f"{node.name}: marked {present}")
    absent = [a for a in _DIM_MARKING_ATTRS if a not in present]
    if not present:
        return [["no_dynamic_marking", absent]]
    # A dimension marked dynamic at capture: later marks may only be a subset.
    dynamic = sorted(int(d) for d in value._dynamo_dynamic_indices)
    return [["no_dynamic_marking", absent, dynamic]]


@leaf_reader("DYNAMIC_INDICES")
def _dynamic_indices(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    """torch 2.11's check of a tensor marked dynamic at capture (torch 2.13 writes
    DIMENSION_DYNAMIC_MARKING_GUARD): the dimensions marked later, if any, are a
    subset of those marked at capture; the other marking attributes are not read."""
    _one(n, "DYNAMIC_INDICES", node)
    marked = getattr(node.need_value(), "_dynamo_dynamic_indices", None)
    if marked is None:
        raise NoLeanGuards(f"{node.name}: a DYNAMIC_INDICES guard on an unmarked tensor")
    return [["no_dynamic_marking", [], sorted(int(d) for d in marked)]]


@leaf_reader("NO_HASATTR")
def _no_hasattr(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    value = node.need_value()
    asked = (hasattr_guard(g)[1] for g in node.guards if guard_kind(g) == "HASATTR")
    attrs = sorted({a for a in asked if a is not None and not hasattr(value, a)})
    leaves: list[list[Any]] = [["no_attr", a] for a in attrs]
    if n > len(attrs) and node.guard_kwargs("TENSOR_MATCH"):
        # torch 2.11 writes a tensor's dimension-marking check as one leaf per
        # attribute: all of them are checked absent (a superset: stricter).
        marked = [a for a in _DIM_MARKING_ATTRS if hasattr(value, a)]
        if marked:
            raise NoLeanGuards(f"{node.name}: marked {marked}")
        if n > len(attrs) + len(_DIM_MARKING_ATTRS):
            raise NoLeanGuards(f"{node.name}: {n} NO_HASATTR leaves")
        return [*leaves, ["no_dynamic_marking", list(_DIM_MARKING_ATTRS)]]
    if len(attrs) != n:
        raise NoLeanGuards(f"{node.name}: {n} NO_HASATTR leaves, {len(attrs)} guards")
    return leaves


@leaf_reader("DICT_CONTAINS", "SET_CONTAINS")
def read_contains(node: LeafNode, n: int, _: Any) -> list[list[Any]]:
    value = node.need_value()
    kinds = ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS")
    keys = {}
    for kind, kw in node.guard_kwargs(*kinds, "NOT_PRESENT_IN_GENERIC_DICT"):
        key = kw.get("attr" if kind == "NOT_PRESENT_IN_GENERIC_DICT" else "key", MISSING)
        if not _literal(key) or isinstance(key, (list, set)):
            raise NoLeanGuards(f"{node.name}: {kind} on a {type(key).__name__}")
        keys[key] = key in value  # Dynamo's guard passed on the live value
    # Leaves of both types are counted together here and in the caller.
    return [["contains", key, present] for key, present in keys.items()]


@leaf_reader("NO_TENSOR_ALIASING")
def _no_aliasing(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    listed = reader.check_fn.guard_manager.no_tensor_aliasing_sources
    # torch 2.15 lists the tensors' sources; earlier ones, their names.
    sources = [source.name for source in listed] if FROM_2_15 else list(listed)
    if node.name not in sources:
        raise NoLeanGuards(f"{node.name}: an aliasing guard on an unlisted tensor")
    return [["no_aliasing", sources]]


@leaf_reader("OBJECT_ALIASING")
def _object_aliasing(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    pairs = [p for p in reader.same_object_leaves() if node.name in p]
    if len(pairs) != n:
        raise NoLeanGuards(f"{node.name}: {n} OBJECT_ALIASING leaves, {len(pairs)} guards")
    return [["same_object", list(p)] for p in pairs]


@leaf_reader("GLOBAL_STATE")
def _global_state(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    _one(n, "GLOBAL_STATE", node)
    state = reader.check_fn.global_state
    if state is None:
        raise NoLeanGuards("a global state guard without its state")
    # With kernels that read the thread count, the lean check leaves the count out.
    return [global_state_leaf(state.__getstate__(), kernels_read_thread_count())]


@leaf_reader("TORCH_FUNCTION_MODE_STACK")
def _tf_stack(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    if reader.output_graph.torch_function_mode_stack:
        raise NoLeanGuards("torch function modes were active at capture")
    return [["no_torch_function_mode"]]


@leaf_reader("DEFAULT_DEVICE")
def _default_device(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    if reader.output_graph.current_device is not None:
        raise NoLeanGuards("a default device was set at capture")
    return [["no_default_device"]]


# Dynamo's lambda leaves say nothing of themselves: each is read from the guard
# that made it, by that guard's builder (``create_fn``), one reader per builder.
_LambdaReader = Callable[[LeafNode, Any, Any], list[list[Any]]]
LAMBDA_READERS: dict[str, _LambdaReader] = {}
lambda_reader = _registrar(LAMBDA_READERS)  # readers of lambda leaves, by the guard's builder


@leaf_reader("LAMBDA_GUARD")
def _lambda(node: LeafNode, n: int, reader: Any) -> list[list[Any]]:
    made = [g for g in node.guards if guard_kind(g) in LAMBDA_READERS]
    if len(made) != n:
        raise NoLeanGuards(f"{node.name}: {n} lambda leaves, {len(made)} known guards")
    return [leaf for g in made for leaf in LAMBDA_READERS[guard_kind(g)](node, g, reader)]


@lambda_reader("AUTOGRAD_SAVED_TENSORS_HOOKS")
def _saved_tensors_hooks(node: LeafNode, guard: Any, reader: Any) -> list[list[Any]]:
    # Dynamo compares the hooks' ids with the capture's; the lean check expects
    # no hooks at all (stricter), so the capture must have had none.
    if not node.is_root:
        raise NoLeanGuards(f"a saved tensors hooks guard on {node.name}")
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        raise NoLeanGuards("saved tensors hooks were active at capture")
    return [["no_saved_tensor_hooks"]]
