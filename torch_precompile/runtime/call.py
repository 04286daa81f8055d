"""The call path: what runs between ``artifact(*args)`` and the compiled kernels.

An artifact's runtime is a short list of steps (:mod:`.steps`) built once (at
``precompile`` or ``load``): bind the arguments, check module hooks, check the
guards, check identities and index ranges, step CUDA graphs, call the compiled
code. The runtime executes the list, under the captured grad mode, and
:class:`VariantRuntime` the first of several variants whose checks pass;
``to_python()`` prints the same list as plain Python, so the two describe one
thing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from .._compat.pytree import tree_leaves
from .._errors import GuardError
from ..guards import AutogradGuard, Guards, IdentityChecks, IndexChecks, call_of, hooks_entry
from .output_layout import keep_layouts
from .signature import CallSignature
from .steps import (
    BindArguments,
    CallCompiled,
    CheckGuards,
    CheckHooks,
    CheckIdentities,
    CheckIndices,
    Frame,
    Step,
)

__all__ = ["Frame", "Runtime", "Step", "VariantRuntime"]


class Runtime:
    """Runs PyTorch's compiled function through the artifact's steps.

    ``bound_self`` is what the traced code sees as ``self``: the live model,
    or a stand-in rebuilt from the file's weights. ``grad_enabled`` is the grad
    mode Dynamo captured under (it guards it): an inference artifact whose
    inputs need no grad runs under it whatever the caller's mode.
    """

    def __init__(
        self,
        compiled_function: Any,
        guards: Guards,
        bound_self: Any,
        training: bool,
        grad_enabled: bool | None = None,
        described: CallSignature | None = None,
    ) -> None:
        described = described or CallSignature()  # the artifact's: the example call, outputs
        output_layouts: Sequence[list[int] | None] | None = described.output_layouts
        if output_layouts:
            _compat.wrap_compiled_graph(
                compiled_function, lambda graph: keep_layouts(graph, output_layouts)
            )
        guard_manager, fn, signature = _compat.compiled_function_parts(compiled_function)
        self.compiled_function = compiled_function
        self.guard_manager = guard_manager
        self.fn = fn
        self.signature: inspect.Signature = signature
        self.closure_locals = _compat.compiled_function_closure_locals(compiled_function)
        self.guards = guards
        self.bound_self = bound_self
        self.training = training
        self.grad_enabled = training if grad_enabled is None else grad_enabled
        # A training artifact is refused under no_grad by its own guard; a file of
        # torch's save_compiled_function has none, and its guard manager decides.
        self._needs_grad = any(isinstance(g, AutogradGuard) and g.training for g in guards)
        self._params: list[torch.Tensor] = (
            list(bound_self.parameters()) if isinstance(bound_self, torch.nn.Module) else []
        )
        self.checks: tuple[Step, ...] = (
            BindArguments(signature, self.closure_locals),
            CheckHooks(hooks_entry(guards), bound_self),
            CheckGuards(
                guard_manager,
                guards,
                described.parameters or {},
                signature,
            ),
            CheckIdentities(IdentityChecks(guards, getattr(fn, "__globals__", {}))),
            CheckIndices(IndexChecks(guards)),
        )
        self.call_step = CallCompiled(
            fn, _compat.compiled_function_uses_cudagraphs(compiled_function)
        )

    @property
    def steps(self) -> tuple[Step, ...]:
        """The call path in order: the checks, then the compiled call."""
        return (*self.checks, self.call_step)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        failure, result = self.try_call(args, kwargs)
        if failure is not None:
            raise failure
        return result

    def refusal(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardError | None:
        """Why the checks would refuse this call (None: they pass); runs no kernel."""
        with self.grad_mode(args, kwargs) as refusal:
            return refusal or self._check(args, kwargs)[0]

    def _check(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[GuardError | None, Frame]:
        """Run the checks on one call: the first refusal (or None) and the bound frame."""
        frame = self._frame(args, kwargs)
        for step in self.checks:
            failure = step.check(frame)
            if failure is not None:
                return failure, frame
        return None, frame

    def try_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``(None, result)``, or ``(GuardError, None)`` without running the compiled code."""
        with self.grad_mode(args, kwargs) as refusal:
            if refusal is not None:
                return refusal, None
            failure, frame = self._check(args, kwargs)
            if failure is not None:
                return failure, None
            return None, self.call_step.call(frame)

    @contextlib.contextmanager
    def grad_mode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run under the captured grad mode; yields a GuardError when that would change
        the result (an inference artifact called while something requires grad)."""
        if self.training or torch.is_grad_enabled() == self.grad_enabled:
            if self._needs_grad and not torch.is_grad_enabled():
                yield GuardError(f"{AutogradGuard.TRAINING_UNDER_NO_GRAD} [aot_autograd]")
            else:
                yield None
            return
        culprit = self._requires_grad(args, kwargs) if torch.is_grad_enabled() else None
        if culprit is not None:
            yield GuardError(f"{AutogradGuard.inference_under_grad(culprit)} [aot_autograd]")
            return
        # Nothing requires grad, so either grad mode gives eager's result.
        with torch.set_grad_enabled(self.grad_enabled):
            yield None

    def try_lean(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """``(True, result)`` when a lean load's plain-Python guards and the other
        checks pass (the arguments bound once, the guards run once); else
        ``(False, None)`` and nothing ran. Never builds PyTorch's guard manager,
        which imports Dynamo."""
        light = getattr(self.guard_manager, "lean_guards", None)
        if light is None:
            return False, None
        with self.grad_mode(args, kwargs) as refusal:
            if refusal is not None:
                return False, None
            frame = self._frame(args, kwargs)
            try:
                self.checks[0].check(frame)  # binds the arguments
            except TypeError:
                return False, None
            try:
                if not light.check(frame.f_locals):
                    return False, None
            except Exception:  # a value its checks cannot read: the full path says why
                return False, None
            if not self._all_but_guards(frame):
                return False, None
            return True, self.call_step.call(frame)

    def _frame(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Frame:
        """The call as the checks see it: ``self`` (the bound model), then the arguments."""
        return Frame((self.bound_self, *args) if self.bound_self is not None else args, kwargs)

    def _all_but_guards(self, frame: Frame) -> bool:
        """Whether every check after binding, the guards left out, passes on ``frame``."""
        return all(
            isinstance(step, CheckGuards) or step.check(frame) is None for step in self.checks[1:]
        )

    def checked_call(self, args: tuple[Any, ...]) -> tuple[Runtime, Any]:
        """The call on the full path, and the runtime whose checks passed (this one)."""
        return self, self(args, {})

    def call_known(self, args: tuple[Any, ...]) -> Any:
        """The call of a loop whose guards held at its first call of this layout
        (:class:`~torch_precompile.runtime.loop.LoopCall`): every check but the
        guards runs (grad mode, hooks, identities, index ranges). A check that
        refuses sends the call down the full path, which says why."""
        with self.grad_mode(args, {}) as refusal:
            if refusal is None:
                frame = self._frame(args, {})
                self.checks[0].check(frame)  # binds the arguments
                if self._all_but_guards(frame):
                    return self.call_step.call(frame)
        return self(args, {})

    def _requires_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                return "an input"
        if any(p.requires_grad for p in self._params):
            return "a parameter of the model"
        return None


class VariantRuntime:
    """Runs the first of several compiled variants whose guards hold for the call
    (each variant's guards are checked once per call)."""

    def __init__(self, variants: Sequence[Any], labels: Sequence[str]) -> None:
        self.variants = tuple(variants)
        self.labels = tuple(labels)
        first = self.variants[0].runtime
        self.bound_self = first.bound_self
        self.training = first.training
        self.grad_enabled = first.grad_enabled
        self._last = 0  # the variant that served the last call

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._served(args, kwargs)[1]

    def checked_call(self, args: tuple[Any, ...]) -> tuple[Runtime, Any]:
        """The call on the full path, and the runtime of the variant that served it."""
        return self._served(args, {})

    def _served(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Runtime, Any]:
        # A loop calls one variant again and again (every decode step): the one that
        # served the last call is tried first. Then, after a lean load, the first
        # variant whose plain-Python guards hold runs before any variant builds
        # PyTorch's guard manager (which imports Dynamo).
        last = self.variants[self._last].runtime
        served, result = last.try_lean(args, kwargs)
        if served:
            return last, result
        for i, variant in enumerate(self.variants):
            if i != self._last:
                served, result = variant.runtime.try_lean(args, kwargs)
                if served:
                    self._last = i
                    return variant.runtime, result
        failures: list[str] = []
        for i, variant in enumerate(self.variants):
            failure, result = variant.runtime.try_call(args, kwargs)
            if failure is None:
                self._last = i
                return variant.runtime, result
            failures.append(str(failure))
        raise GuardError(self._refusal(failures, args, kwargs))

    def _refusal(self, failures: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The variant closest to the call (the fewest guards broken) and what differs,
        then each other distinct failure once."""
        distances = [_broken(v.runtime, args, kwargs) for v in self.variants]
        closest = min(range(len(failures)), key=lambda i: (distances[i], i))
        alike = [i for i, f in enumerate(failures) if f == failures[closest]]
        names = ", ".join(f"{i} ({self.labels[i]})" for i in alike)
        lines = [
            f"no variant's guards hold for this call; the closest, variant{'s' * (len(alike) > 1)} "
            f"{names}: {failures[closest]}"
        ]
        seen = {failures[closest]}
        for i, failure in enumerate(failures):
            if failure not in seen:
                seen.add(failure)
                lines.append(f"variant {i} ({self.labels[i]}): {failure}")
        return "\n  ".join(lines)


def _broken(runtime: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How many of a variant's guards the call breaks (a call it cannot bind: many)."""
    try:
        _, frame = runtime._check(args, kwargs)
        call = call_of(list(runtime.guards), frame.f_locals)
        return sum(1 for g in runtime.guards if _breaks(g, call))
    except Exception:
        return 1 << 30


def _breaks(guard: Any, call: Any) -> bool:
    try:
        return guard.problem(call) is not None
    except Exception:
        return True
