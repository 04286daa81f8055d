"""Dynamo's own guard manager, where the lean guards cannot decide a call: rebuilt
from the saved state on first need (this imports ``torch._dynamo``, never a
compiler), and the module-hook guards it is built with."""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable
from typing import Any

from .._stable import moved_modules_answered
from .guards import LeanGuards


def hook_guards_enabled() -> contextlib.AbstractContextManager[None]:
    """Make Dynamo guard the module hook dicts it read as empty.

    Dynamo records an ``EMPTY_NN_MODULE_HOOKS_DICT`` guard for each hook dict
    (forward, forward-pre, backward, backward-pre) of every submodule whose
    ``__call__`` it inlined, but by default (``skip_nnmodule_hook_guards``)
    builds nothing for it, so a hook added later is silently ignored. With
    the flag off each becomes a dict-length check in the guard tree. The flag
    is read when the guard manager is built, at precompile and again when
    PyTorch rebuilds it from the saved state, so each build runs under this.
    """
    from torch._dynamo import config as dynamo_config

    return dynamo_config.patch(skip_nnmodule_hook_guards=False)


class LeanGuardManager:
    """Lean guards first; Dynamo's guard manager, built on first need, decides the rest."""

    def __init__(self, light: LeanGuards | None, build_full: Callable[[], Any]) -> None:
        self.lean_guards = light
        self._build_full = build_full
        self._full: Any = None

    @property
    def full(self) -> Any:
        if self._full is None:
            self._full = self._build_full()
        return self._full

    def check(self, f_locals: dict[str, Any]) -> bool:
        if self.lean_guards is not None and self.lean_guards.check(f_locals):
            return True
        if self.lean_guards is not None and self._full is None:
            log = logging.getLogger("torch_precompile")
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "the lean guards refused a call (%s); Dynamo's guard manager decides "
                    "(this imports torch._dynamo)",
                    self.lean_guards.why_not(f_locals),
                )
        return bool(self.full.check(f_locals))

    def check_verbose(self, f_locals: dict[str, Any]) -> Any:
        return self.full.check_verbose(f_locals)


def load_dynamo_guard_manager(
    guards_state: bytes,
    original_code: types.CodeType,
    f_globals: dict[str, Any],
    hook_guards: bool = False,
) -> Any:
    """Dynamo's guard manager from its saved state (imports torch._dynamo, not the compilers).

    ``hook_guards``: the state was saved with module hook guards (see
    :func:`hook_guards_enabled`).
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.package import load_guard_manager, load_guards_state
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, compile_context

    with (
        compile_context(CompileContext(convert_frame.get_compile_id({}))),
        get_metrics_context(),
        hook_guards_enabled() if hook_guards else contextlib.nullcontext(),
        moved_modules_answered(),  # built at a call, after the load: the file's old paths
    ):
        return load_guard_manager(load_guards_state(guards_state), original_code, f_globals)
