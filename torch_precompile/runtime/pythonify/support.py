"""What a module written by ``PrecompiledArtifact.to_python()`` imports.

A small, stable surface: loading the artifact's pieces by name, and the few
helpers its plain-Python guard checks call. Generated modules import nothing
else from torch_precompile, so they keep working while the package's
internals change.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from ... import _compat
from ..._errors import GuardError
from ...guards import Guards, Identity, diagnose, identity_of
from ...guards._python import dtype_name, plain
from ..call import CheckHooks, Frame

__all__ = [
    "GuardError",
    "Identity",
    "Parts",
    "any_requires_grad",
    "autocast_enabled",
    "describe_identity",
    "dtype_name",
    "global_state",
    "identity_of",
    "parts_of",
    "plain",
]


@dataclasses.dataclass
class Parts:
    """A loaded artifact's pieces, in plain names."""

    artifact: Any
    model: Any
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    closure: dict[str, Any]
    globals: dict[str, Any]
    compiled_graph: Any
    dynamo_fn: Any
    defaults: dict[str, Any]
    _guard_manager: Any
    _hooks: CheckHooks
    _guards: Guards

    def check_hooks(self, f_locals: dict[str, Any]) -> None:
        """Raise GuardError if a module hook is registered that the compiled code would skip."""
        failure = self._hooks.check(Frame((), {}, f_locals))
        if failure is not None:
            raise failure

    @property
    def tree(self) -> Any:
        """The guard tree as plain Python (a lean load's lean guards), or None."""
        return getattr(self._guard_manager, "lean_guards", None)

    def tree_digest(self) -> str | None:
        """A short digest of the guard tree's source (a generated module checks it)."""
        tree = self.tree
        if tree is None:
            return None
        return hashlib.sha256(tree.source.encode()).hexdigest()[:16]

    def tree_collected_ok(self, seen: dict[str, Any], tensors: list[Any]) -> bool:
        """Strides, dispatch keys and aliasing of the tensors the tree collected."""
        return bool(self.tree.collected_ok(seen, tensors))

    def explain(self, f_locals: dict[str, Any]) -> None:
        """Raise the GuardError that says which guard this call breaks."""
        reason = "the guard tree (strides, aliasing, module structure) differs"
        raise diagnose(self._guards, f_locals, reason)

    def check_structure(self, f_locals: dict[str, Any]) -> None:
        """The rest of the guard tree (strides, aliasing, module structure, attributes):
        PyTorch's guard manager, or its plain-Python translation after a lean load."""
        if not self._guard_manager.check(f_locals):
            reason = _compat.guard_failure_reason(self._guard_manager, f_locals)
            raise diagnose(self._guards, f_locals, reason)


def parts_of(artifact: Any) -> Parts:
    """The model (or stand-in), its tensors by name and the compiled graph of ``artifact``."""
    runtime = artifact.runtime
    model = runtime.bound_self
    is_module = isinstance(model, torch.nn.Module)
    cf = artifact.compiled_function
    hooks = next(s for s in runtime.checks if isinstance(s, CheckHooks))
    return Parts(
        artifact=artifact,
        model=model,
        # remove_duplicate=False: a tied weight is found under each of its names.
        params=dict(model.named_parameters(remove_duplicate=False)) if is_module else {},
        buffers=dict(model.named_buffers(remove_duplicate=False)) if is_module else {},
        closure=dict(runtime.closure_locals),
        globals=_compat.compiled_function_globals(cf),
        compiled_graph=_compat.compiled_graph_callable(cf),
        dynamo_fn=runtime.fn,
        defaults={
            k: p.default
            for k, p in runtime.signature.parameters.items()
            if p.default is not p.empty
        },
        _guard_manager=runtime.guard_manager,
        _hooks=hooks,
        _guards=runtime.guards,
    )


def autocast_enabled() -> bool:
    """Whether autocast is on for CPU or CUDA."""
    cuda = torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    return torch.is_autocast_enabled("cpu") or cuda


def any_requires_grad(value: Any) -> bool:
    """Whether a tensor in ``value`` (nested lists, tuples, dicts) requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(any_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(any_requires_grad(v) for v in value.values())
    return False


def global_state() -> dict[str, Any]:
    """The process-wide state Dynamo guards, by the names the guards use."""
    return _compat.global_state_snapshot()


def describe_identity(value: Any) -> str:
    """What ``value`` is, in the words of an identity guard."""
    found = identity_of(value)
    return str(found) if found else f"a {type(value).__name__}"
