"""Guards: what an artifact assumes about its inputs and the process, in words.

``Guards`` is the readable, ordered record each stage extends; each entry is
a typed :class:`Guard` (one class per kind) holding its data, its check, its
message and its Python form. The fast check at call time is PyTorch's guard
manager (or its plain-Python translation after a lean load); when it refuses a
call, the entries here say which assumption broke, what was expected, what was
found, and which stage added it.
"""

from ._arguments import explain_arguments
from ._base import PHASES, Call, Guard, Note, note
from ._checks import IdentityChecks, IndexChecks, call_of, diagnose, hooks_entry, unmet_by
from ._collection import Guards
from ._identity import Identity, code_hash, identity_of
from ._objects import DroppedGuard, ExtentGuard, HooksGuard, IdentityGuard, IndexGuard
from ._shapes import RangeGuard, ShapeGuard
from ._source import MISSING, ROOT_SOURCE, UNRESOLVED, Source, describe_source, split_size
from ._translate import (
    DROP_CATEGORIES,
    capture_guards,
    dropped_guard,
    identity_guard,
    range_guards,
    requires_grad_note,
    serializable_guard_filter,
    shape_guards,
    source_is_rechecked,
)
from ._values import AutogradGuard, GlobalStateGuard, SystemGuard, TensorGuard, ValueGuard

__all__ = [
    "DROP_CATEGORIES",
    "MISSING",
    "PHASES",
    "ROOT_SOURCE",
    "UNRESOLVED",
    "AutogradGuard",
    "Call",
    "DroppedGuard",
    "ExtentGuard",
    "GlobalStateGuard",
    "Guard",
    "Guards",
    "HooksGuard",
    "Identity",
    "IdentityChecks",
    "IdentityGuard",
    "IndexChecks",
    "IndexGuard",
    "Note",
    "RangeGuard",
    "ShapeGuard",
    "Source",
    "SystemGuard",
    "TensorGuard",
    "ValueGuard",
    "call_of",
    "capture_guards",
    "code_hash",
    "describe_source",
    "diagnose",
    "dropped_guard",
    "explain_arguments",
    "hooks_entry",
    "identity_guard",
    "identity_of",
    "note",
    "range_guards",
    "requires_grad_note",
    "serializable_guard_filter",
    "shape_guards",
    "source_is_rechecked",
    "split_size",
    "unmet_by",
]
