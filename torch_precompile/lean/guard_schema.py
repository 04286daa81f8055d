"""The lean format's schema, its guard tree: Dynamo's guard tree as the lean check
reads it (:class:`GuardTree`, :class:`GuardNode`, :class:`GuardDict`; a leaf is
``[kind, *arguments]``), the DTensor spec a leaf records (:class:`DTensorSpecRecord`),
and the check's emission a save keeps (:class:`Emitted`). Each record's ``write()``
and ``read()`` sit side by side, as in :mod:`.schema`, which holds the section."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .schema import unversioned, versioned

# What ``Emitted`` holds: bumped whenever the source the emitter writes, the names it
# expects in the namespace or the constants change, so that a file's saved emission
# is used only by a load that would have written the same.
EMITTED_VERSION = 1

# A step from a node's value to a child's: ``["local", name]``, ``["item", key]``,
# ``["attr", name]`` (getattr), ``["oattr", name]`` (object.__getattribute__) or
# ``["vars"]`` (its ``__dict__``). A leaf: ``[kind, *arguments]`` (``lean_writer/guard_leaves``
# writes each kind, ``.guard_emit`` reads it).
Step = list[Any]
Leaf = list[Any]


@dataclasses.dataclass(frozen=True)
class GuardDict:
    """A dict node's guard: its size, and per entry guarded ``(index, key's node,
    value's node)``. ``config``: a config that is a dict (its stand-in may not be
    one); ``ordered``: an OrderedDict (a module's hook dict)."""

    size: int
    entries: list[tuple[int, GuardNode | None, GuardNode | None]]
    config: bool = False
    ordered: bool = False

    def write(self) -> dict[str, Any]:
        return {
            **({"config": True} if self.config else {}),
            **({"ordered": True} if self.ordered else {}),
            "size": self.size,
            "entries": [
                [i, None if k is None else k.write(), None if v is None else v.write()]
                for i, k, v in self.entries
            ],
        }

    @classmethod
    def read(cls, stored: dict[str, Any]) -> GuardDict:
        entries = [
            (
                int(i),
                None if k is None else GuardNode.read(k),
                None if v is None else GuardNode.read(v),
            )
            for i, k, v in stored["entries"]
        ]
        return cls(
            int(stored["size"]), entries, bool(stored.get("config")), bool(stored.get("ordered"))
        )


@dataclasses.dataclass(frozen=True)
class GuardNode:
    """One node of Dynamo's guard tree: the source it reads (Dynamo's name), the
    leaves checked on its value, its children (each with the step to it) and, for
    a dict, its entries."""

    source: str
    leaves: list[Leaf]
    children: list[tuple[Step, GuardNode]]
    dict: GuardDict | None = None

    def write(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source,
            "leaves": self.leaves,
            "children": [[step, child.write()] for step, child in self.children],
        }
        if self.dict is not None:
            out["dict"] = self.dict.write()
        return out

    @classmethod
    def read(cls, stored: dict[str, Any]) -> GuardNode:
        found = stored.get("dict")
        return cls(
            stored["source"],
            stored["leaves"],
            [(step, cls.read(child)) for step, child in stored["children"]],
            None if found is None else GuardDict.read(found),
        )


@dataclasses.dataclass(frozen=True)
class GuardTree:
    """The lean check's spec: the tree from the frame's locals (``L``) down, and
    Dynamo's shape guards (Python expressions of the lean grammar), stored on the
    root (absent: no dynamic shapes)."""

    root: GuardNode
    shape_guards: tuple[str, ...] = ()

    def write(self) -> dict[str, Any]:
        out = self.root.write()
        if self.shape_guards:
            out["shape_guards"] = list(self.shape_guards)
        return out

    @classmethod
    def read(cls, stored: dict[str, Any]) -> GuardTree:
        return cls(GuardNode.read(stored), tuple(stored.get("shape_guards", ())))


def global_state_leaf(state: str, any_threads: bool) -> Leaf:
    """The ``global_state`` leaf: Dynamo's global state (its JSON), and whether the
    check leaves the thread count out (kernels that read it as they run)."""
    return ["global_state", state, *([{"any_threads": True}] if any_threads else [])]


def global_state_any_threads(leaf: Leaf) -> bool:
    """Whether a ``global_state`` leaf (:func:`global_state_leaf`) leaves the count out."""
    return len(leaf) > 2 and bool(leaf[2].get("any_threads"))


@dataclasses.dataclass(frozen=True)
class DTensorSpecRecord:
    """What a DTensor spec guard compares (a ``dtensor_spec`` leaf's argument): the
    placements' and shard order's reprs, the dtype's name (None: no tensor meta) and
    the mesh's descriptor (``lean_writer.dtensor_guards.mesh_descriptor``)."""

    placements: str
    shard_order: str
    dtype: str | None
    mesh: list[Any]

    def write(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, stored: dict[str, Any]) -> DTensorSpecRecord:
        return cls(**stored)


# (python type, dtype, requires_grad, size, stride, dispatch keys, device): a size or
# stride of None is dynamic; a device of None is the CPU, an int a CUDA index.
TensorCheck = tuple[
    type, torch.dtype, bool, tuple[int | None, ...], tuple[int | None, ...], int, int | None
]


@dataclasses.dataclass(frozen=True)
class Emitted:
    """A guard tree turned into Python: the check's source, the constants it reads, and
    what it leaves to be checked together (tensors, aliasing). The same for one tree on
    one version of this package and of torch, so the save keeps it
    (:attr:`CompiledPython.prepared`)."""

    source: str
    consts: dict[str, Any]
    tensor_checks: list[TensorCheck]
    alias_groups: list[list[str]]  # distinct, non-overlapping tensors
    same_groups: list[list[str]]  # one object (OBJECT_ALIASING)

    def write(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return versioned(EMITTED_VERSION, fields)

    @classmethod
    def read(cls, stored: Any) -> Emitted | None:
        """The emission, if ``stored`` is one of this version (else None: emit again)."""
        try:
            return cls(**unversioned(stored, (EMITTED_VERSION,), "emission"))
        except (TypeError, ValueError):  # another version's, or not an emission
            return None
