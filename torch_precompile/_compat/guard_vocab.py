"""Dynamo's guard vocabulary, translated into the few categories the package uses.

Dynamo names its guards by the function that builds them (``TENSOR_MATCH``,
``ID_MATCH``, ``EMPTY_NN_MODULE_HOOKS_DICT``, ...), a vocabulary that changes
between releases. Nothing outside ``_compat`` reads those names: this module
sorts a capture's guards, and the entries of Dynamo's save-time guard filter,
into categories with plain meanings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..lean.standin.config import is_config
from .capture import UNSERIALIZABLE_GUARD_KINDS
from .guard_manager import (
    guard_filter_entry_derived_kinds,
    guard_filter_entry_fields,
    guard_filter_entry_hasattr_name,
    guard_filter_entry_source,
    hasattr_owner,
)

# Kinds that describe module plumbing rather than a user-visible assumption;
# still checked, but summarised in one entry.
_GLOBAL_STATE_KINDS = frozenset(
    {
        "GLOBAL_STATE",
        "GRAD_MODE",
        "DEFAULT_DEVICE",
        "DETERMINISTIC_ALGORITHMS",
        "TORCH_FUNCTION_STATE",
        "AUTOGRAD_SAVED_TENSORS_HOOKS",
        "FSDP_TRAINING_STATE",
    }
)
_IDENTITY_KINDS = frozenset(
    {"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "CLASS_MATCH", "MODULE_MATCH"}
)


@dataclasses.dataclass(frozen=True)
class CapturedGuard:
    """One guard of a capture: ``category`` is ``tensor`` (properties of a tensor),
    ``value`` (equality with a constant), ``global_state``, ``hook_dict`` (a module's
    hook dict read as empty), ``shape_env`` (the symbolic-shape guards, listed
    separately) or ``structure``; ``detail`` is Dynamo's name, for summaries."""

    category: str
    source: str
    detail: str


def captured_guards(dynamo_guards: Sequence[Any]) -> Iterator[CapturedGuard]:
    """A capture's guards by category, each (category, source) once."""
    seen: set[tuple[str, str]] = set()
    for g in dynamo_guards:
        kind = g.create_fn_name()
        if kind == "TENSOR_MATCH":
            category = "tensor"
        elif kind in ("CONSTANT_MATCH", "EQUALS_MATCH"):
            category = "value"
        elif kind in _GLOBAL_STATE_KINDS:
            category = "global_state"
        elif kind == "SHAPE_ENV":
            category = "shape_env"
        elif kind == "EMPTY_NN_MODULE_HOOKS_DICT":
            category = "hook_dict"
        else:
            category = "structure"
        key = (category if category != "structure" else kind, g.name)
        if key in seen:
            continue
        seen.add(key)
        yield CapturedGuard(category, g.name, kind)


@dataclasses.dataclass(frozen=True)
class SaveCandidate:
    """An entry of Dynamo's save-time guard filter.

    ``drop`` says why the guard cannot be saved as it is: ``module type``,
    ``class attribute``, ``identity`` (an object identity of this process) or
    ``global`` (a global of the capturing process); None when it is saved.
    ``is_identity``: an identity match that a savable identity guard can replace.
    """

    label: str
    source: str
    value: Any
    drop: str | None
    is_identity: bool


def _class_fact(entry: Any, name: str, value: Any) -> bool:
    """Whether a HASATTR guard asks about an attribute of the object's class.

    Module types are not saved: the guard state holds a plain module with the
    instance's attributes, so a class attribute (``hasattr(module_list,
    '__iter__')`` on torch 2.11, diffusers' ``_keep_in_fp32_modules``) would be
    rebuilt at load as ``not hasattr`` and refuse every call. Its value, where the
    code read it, is baked into the traced bytecode.
    """
    if re.search(r"\.__\w+__$", name):  # torch 2.11 names the attribute itself
        return True
    attr = guard_filter_entry_hasattr_name(entry)
    if attr is None:  # torch 2.11: the guard's source and value are the attribute's
        owner = hasattr_owner(entry)
        if owner is None:
            return False
        attr, value = owner
    if isinstance(value, type):
        return False
    own = getattr(value, "__dict__", None)
    return isinstance(own, dict) and attr not in own and hasattr(type(value), attr)


def save_candidate(entry: Any) -> SaveCandidate:
    """Sort one entry of Dynamo's guard filter."""
    name, kind, is_global, value = guard_filter_entry_fields(entry)
    derived = guard_filter_entry_derived_kinds(entry)
    module_class = isinstance(value, type) and issubclass(value, torch.nn.Module)
    drop: str | None = None
    if (kind in ("TYPE_MATCH", "ID_MATCH") and isinstance(value, torch.nn.Module)) or module_class:
        drop = "module type"
    elif kind == "TYPE_MATCH" and name.startswith("self.") and is_config(value):
        drop = "config type"
    elif "type(" in name or (kind == "HASATTR" and _class_fact(entry, name, value)):
        drop = "class attribute"
    elif kind in UNSERIALIZABLE_GUARD_KINDS or any(
        d in UNSERIALIZABLE_GUARD_KINDS for d in derived
    ):
        drop = "identity"
    elif is_global:
        drop = "global"
    is_identity = (kind in _IDENTITY_KINDS or "ID_MATCH" in derived) and not module_class
    return SaveCandidate(
        f"{kind} {name}".strip(), guard_filter_entry_source(entry), value, drop, is_identity
    )
