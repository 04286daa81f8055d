"""The call path's steps: each check between ``artifact(*args)`` and the compiled
kernels, and the compiled call itself, on one call's :class:`Frame`.

:class:`~torch_precompile.runtime.call.Runtime` builds the list once and runs it;
``to_python()`` (:mod:`.pythonify`) prints each step as code.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from .. import _compat
from .._errors import GuardError
from ..guards import (
    ROOT_SOURCE,
    Guards,
    HooksGuard,
    IdentityChecks,
    IndexChecks,
    call_of,
    diagnose,
    explain_arguments,
)
from .signature import make_binder


@dataclasses.dataclass
class Frame:
    """One call as the steps see it: the arguments, then the traced frame's locals."""

    full: tuple[Any, ...]
    kwargs: dict[str, Any]
    f_locals: dict[str, Any] = dataclasses.field(default_factory=dict)


class Step:
    """One step of the call path. ``check`` returns a GuardError to refuse the call."""

    def check(self, frame: Frame) -> GuardError | None:
        return None


@dataclasses.dataclass
class BindArguments(Step):
    """Map the call's arguments to the traced function's parameters (defaults applied)."""

    signature: inspect.Signature
    closure_locals: dict[str, Any]

    def __post_init__(self) -> None:
        self._bind = make_binder(self.signature)

    def check(self, frame: Frame) -> GuardError | None:
        try:
            arguments = self._bind(*frame.full, **frame.kwargs)
        except TypeError as exc:
            raise TypeError(
                f"arguments do not match the captured signature {self.signature}: {exc}"
            ) from None
        frame.f_locals = {**self.closure_locals, **arguments} if self.closure_locals else arguments
        return None


@dataclasses.dataclass
class CheckHooks(Step):
    """Module hooks the compiled code would not run: the model's own and global ones
    here (the submodules' are in PyTorch's guard tree)."""

    guard: HooksGuard | None
    bound_self: Any

    def __post_init__(self) -> None:
        sources = self.guard.modules if self.guard is not None else ()
        if self.guard is None and isinstance(self.bound_self, torch.nn.Module):
            sources = (ROOT_SOURCE,)  # saved before the ``hooks`` entry existed
        self.sources = sources
        root = self.bound_self if ROOT_SOURCE in sources else None
        self._present = _compat.hook_check(root, bool(sources))

    def check(self, frame: Frame) -> GuardError | None:
        if self._present is None or not self._present():
            return None
        guard = self.guard or HooksGuard.of((), True)
        return guard.error(call_of((), frame.f_locals)) or GuardError(
            f"{HooksGuard.NO_HOOKS_RUN} [dynamo]"
        )


@dataclasses.dataclass
class CheckGuards(Step):
    """PyTorch's guard manager (or its plain-Python translation after a lean load);
    when it refuses, the typed guards say which assumption broke."""

    guard_manager: Any
    guards: Guards
    parameters: dict[str, Any]  # the example call, by parameter (the header's)
    signature: inspect.Signature  # the traced function's

    def check(self, frame: Frame) -> GuardError | None:
        try:
            if self.guard_manager.check(frame.f_locals):
                return None
            reason = _compat.guard_failure_reason(self.guard_manager, frame.f_locals)
        except Exception as exc:  # a guard that cannot read this value (a tensor as a float)
            reason = f"{type(exc).__name__}: {exc}"
        arguments = explain_arguments(self.parameters, frame.f_locals, self.signature)
        return diagnose(self.guards, frame.f_locals, reason, arguments)


@dataclasses.dataclass
class CheckIdentities(Step):
    """Functions, classes and modules the traced code used, by identity across processes."""

    identities: IdentityChecks

    def check(self, frame: Frame) -> GuardError | None:
        return self.identities.check(frame.f_locals)


@dataclasses.dataclass
class CheckIndices(Step):
    """Index inputs in range, else IndexError as eager (Inductor's kernels would abort)."""

    indices: IndexChecks

    def check(self, frame: Frame) -> GuardError | None:
        self.indices.check(frame.f_locals)
        return None


@dataclasses.dataclass
class CallCompiled(Step):
    """Dynamo's transformed bytecode: extracts the graph inputs, calls the compiled
    graph, rebuilds the output (and steps CUDA graphs first, under reduce-overhead)."""

    fn: Any
    cudagraphs: bool

    def call(self, frame: Frame) -> Any:
        if self.cudagraphs:
            _compat.begin_cudagraph_step()
        return self.fn(*frame.full, **frame.kwargs)
