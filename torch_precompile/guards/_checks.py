"""Checks at call time that run beside PyTorch's guard manager, and the diagnosis
that says in words which guard a refused call breaks."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._errors import GuardError
from ._base import Call, Guard
from ._identity import installed_library
from ._objects import ExtentGuard, HooksGuard, IdentityGuard, IndexGuard
from ._python import render
from ._shapes import RangeGuard
from ._source import MISSING, Source
from ._values import AutogradGuard, TensorGuard, ValueGuard


def call_of(guards: Sequence[Guard], f_locals: dict[str, Any]) -> Call:
    """A call's view for the checks: its locals, grad mode and dynamic sizes."""
    sizes = {}
    for g in guards:
        if isinstance(g, RangeGuard):
            size = g.size(f_locals)
            if size is not None:
                sizes[g.symbol] = size
    return Call(f_locals, torch.is_grad_enabled(), sizes)


def _rank(g: Guard) -> int:
    # Grad mode first, then the recorded ranges (they say what sizes are served),
    # then everything else in stage order, and module hooks last: a hook that is
    # meant to be there (DTensor's, rebuilt on a stand-in) must not hide the
    # guard that actually broke.
    if isinstance(g, AutogradGuard):
        return 0
    if isinstance(g, RangeGuard):
        return 1
    return 3 if isinstance(g, HooksGuard) else 2


def diagnose(
    guards: Sequence[Guard], f_locals: dict[str, Any], fallback: str, arguments: str | None = None
) -> GuardError:
    """Which guard the call breaks, as a GuardError (``fallback``: PyTorch's own reason;
    ``arguments``: how the call's arguments differ from the capture's, if they do)."""
    call = call_of(guards, f_locals)
    for g in sorted(guards, key=_rank):
        error = g.error(call)
        if error is not None:
            return error
    if arguments is not None:
        return GuardError(f"{arguments} [dynamo]")
    return GuardError(
        f"a guard failed: {fallback}{_inference_mode_hint(fallback, f_locals)} [dynamo]"
    )


def unmet_by(guards: Sequence[Guard], self_value: Any, identities: bool = False) -> list[str]:
    """The tensor and value guards on ``self`` that ``self_value`` (a stand-in) breaks;
    ``identities``: the identity guards on its functions and classes too."""
    call = Call({"self": self_value}, torch.is_grad_enabled())
    kinds: tuple[type, ...] = (
        (TensorGuard, ValueGuard, IdentityGuard)
        if identities
        else (
            TensorGuard,
            ValueGuard,
        )
    )
    problems = []
    for g in guards:
        if isinstance(g, kinds) and g.source.startswith("L['self']"):
            problem = g.problem(call)
            if problem:
                problems.append(problem)
    return problems


def hooks_entry(guards: Sequence[Guard]) -> HooksGuard | None:
    """The ``hooks`` entry (None: the guards were saved before it existed)."""
    return next((g for g in guards if isinstance(g, HooksGuard)), None)


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)


def _inference_mode_hint(reason: str, f_locals: dict[str, Any]) -> str:
    """What to do when a dispatch-key mismatch comes from ``torch.inference_mode()``."""
    m = re.search(r"expected (DispatchKeySet\([^)]*\)), actual (DispatchKeySet\([^)]*\))", reason)
    if m is None:
        return ""
    expected, actual = m.groups()
    if "ADInplaceOrView" in expected and "ADInplaceOrView" not in actual:
        if any(t.is_inference() for t in _tensors_in(f_locals)):
            return (
                "; an input is an inference tensor (made under torch.inference_mode()) and the "
                "capture saw normal tensors: make the inputs outside inference_mode, or capture "
                "under torch.inference_mode()"
            )
    elif "Autograd" in actual and "Autograd" not in expected:
        return (
            "; the capture ran under torch.inference_mode() with inference tensors: call it "
            "under torch.inference_mode() with inputs made there, or capture without it"
        )
    return ""


class IdentityChecks:
    """The identity guards of an artifact, checked cheaply.

    Locals (closure variables, arguments) are checked on each call, by full
    comparison only when the object differs from the last one that passed.
    Globals are checked once. A global read from a module this process has not
    imported is checked when the module is first seen imported, if the library
    installed here is the version the capture saw: until then nothing in this
    process can have changed it, so a load never imports a model library for
    its identity guards. Any other global is checked at load.
    """

    def __init__(self, guards: Sequence[Guard], f_globals: dict[str, Any]) -> None:
        entries = [g for g in guards if isinstance(g, IdentityGuard)]
        self.local = [(g, Source.parse(g.source)) for g in entries if g.source.startswith("L[")]
        self.global_failure: GuardError | None = None
        self._f_globals = f_globals
        # module -> its guards, checked once the module is imported
        self.pending: dict[str, list[tuple[IdentityGuard, Source]]] = {}
        now = []
        for g in entries:
            source = Source.parse(g.source)
            if source is None or source.is_local:
                continue
            module = source.module(g.scope_module)
            if (
                module is not None
                and module not in sys.modules
                and g.library is not None
                and installed_library(module) == g.library
            ):
                self.pending.setdefault(module, []).append((g, source))
            else:
                now.append((g, source))
        self._check_globals(now)
        self._passed: dict[int, Any] = {}

    def _check_globals(self, entries: Sequence[tuple[IdentityGuard, Source]]) -> None:
        for g, source in entries:
            problem = g.check_value(source.resolve({}, self._f_globals, g.scope_module))
            if problem:
                self.global_failure = GuardError(f"{problem} [{g.phase}]")
                return

    def check(self, f_locals: dict[str, Any]) -> GuardError | None:
        if self.pending and self.global_failure is None:
            for module in [m for m in self.pending if m in sys.modules]:
                self._check_globals(self.pending.pop(module))
        if self.global_failure is not None:
            return self.global_failure
        for i, (g, source) in enumerate(self.local):
            value = source.resolve(f_locals) if source is not None else MISSING
            if value is not MISSING and self._passed.get(i) is value:
                continue
            problem = g.check_value(value)
            if problem:
                return GuardError(f"{problem} [{g.phase}]")
            self._passed[i] = value
        return None


class IndexChecks:
    """The ``index`` guards of an artifact, checked before each call (CPU tensors).

    One ``torch.aminmax`` per index input. CUDA tensors are not checked here
    (it would synchronise every call): Inductor's Triton kernels assert on the
    device, as eager's CUDA embedding does. Positions computed from sizes
    (``extent`` guards) are checked on every device: they read shapes only.
    """

    def __init__(self, guards: Sequence[Guard]) -> None:
        self.checks: list[tuple[Callable[[dict[str, Any]], Any], IndexGuard]] = []
        self.extents: list[tuple[list[Callable[[dict[str, Any]], Any]], ExtentGuard]] = []
        for g in guards:
            source = Source.parse(g.source) if isinstance(g, IndexGuard) else None
            if source is not None and source.is_local:
                self.checks.append((source.resolve, g))  # type: ignore[arg-type]
            if isinstance(g, ExtentGuard):
                sources = [Source.parse(s) for s, _, _ in g.terms]
                if sources and all(s is not None and s.is_local for s in sources):
                    self.extents.append(([s.resolve for s in sources], g))  # type: ignore[union-attr]

    def check(self, f_locals: dict[str, Any]) -> None:
        """Raise IndexError naming the input and the range if an index is out of range."""
        for resolve, g in self.checks:
            t = resolve(f_locals)
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
                continue
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                continue
            lo, hi = torch.aminmax(t)
            lo_v, hi_v = int(lo), int(hi)
            if lo_v < g.min or hi_v >= g.max:
                raise IndexError(render(g.out_of_range(str(lo_v), str(hi_v))))
        for resolves, e in self.extents:
            sizes = []
            for (_, dim, _), resolve in zip(e.terms, resolves):
                t = resolve(f_locals)
                if not isinstance(t, torch.Tensor) or dim >= t.dim():
                    break
                sizes.append(int(t.shape[dim]))
            else:
                reached = e.reached(sizes)
                if reached >= e.max:
                    raise IndexError(render(e.past_end(str(reached), [str(n) for n in sizes])))
