"""Module hooks: the hook dicts ``nn.Module.__call__`` reads, checked at each call.

The compiled code runs ``model.forward`` with every submodule call inlined as
Dynamo traced it: a hook registered after capture would not run. Dynamo's
guard tree covers the hook dicts of the submodules whose ``__call__`` it
inlined (see :func:`torch_precompile.lean.hook_guards_enabled`); this module covers
what the tree cannot see: the hooks of the model itself (the artifact is
called in place of ``model(...)``, whose ``__call__`` would run them) and the
process-wide hooks of ``torch.nn.modules.module.register_module_*_hook``,
which fire on every module. Both are emptiness checks of a few dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

# Attribute of an nn.Module -> what a user calls the hooks it holds.
MODULE_HOOK_DICTS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
GLOBAL_HOOK_DICTS = {
    "_global_forward_pre_hooks": "global forward pre-hook "
    "(torch.nn.modules.module.register_module_forward_pre_hook)",
    "_global_forward_hooks": "global forward hook "
    "(torch.nn.modules.module.register_module_forward_hook)",
    "_global_backward_pre_hooks": "global backward pre-hook "
    "(torch.nn.modules.module.register_module_full_backward_pre_hook)",
    "_global_backward_hooks": "global backward hook "
    "(torch.nn.modules.module.register_module_full_backward_hook)",
}


def hook_check(root: Any, inlined_modules: bool) -> Callable[[], bool] | None:
    """A cheap ``() -> bool``: True when a hook is registered that the compiled code
    would not run. None when nothing can matter (no module is called).

    ``root`` is the module bound as ``self`` (its own hooks count: the artifact
    stands for ``root(...)``), or None; ``inlined_modules`` says whether the
    compiled code inlined some module's ``__call__`` (global hooks then count).
    The dicts are read through their owners at each call, so a dict replaced
    by assignment is still seen.
    """
    g = _nn_module

    def check_global() -> bool:
        return bool(
            g._global_forward_pre_hooks
            or g._global_forward_hooks
            or g._global_backward_pre_hooks
            or g._global_backward_hooks
        )

    if isinstance(root, torch.nn.Module):
        m = root

        def check() -> bool:
            return bool(
                m._forward_pre_hooks
                or m._forward_hooks
                or m._backward_pre_hooks
                or m._backward_hooks
                or check_global()
            )

        return check
    return check_global if inlined_modules else None


def registered_hooks(module: Any) -> list[tuple[str, Any]]:
    """``(kind in words, hook)`` of each hook registered on ``module``."""
    out = []
    for attr, words in MODULE_HOOK_DICTS.items():
        hooks = getattr(module, attr, None)
        if isinstance(hooks, dict):
            out.extend((words, hook) for hook in hooks.values())
    return out


def registered_global_hooks() -> list[tuple[str, Any]]:
    """``(kind in words, hook)`` of each process-wide module hook."""
    out = []
    for attr, words in GLOBAL_HOOK_DICTS.items():
        hooks = getattr(_nn_module, attr, None)
        if isinstance(hooks, dict):
            out.extend((words, hook) for hook in hooks.values())
    return out


def hook_dict_words(source: str) -> str | None:
    """What a Dynamo source ending in a module hook dict holds (``forward hook``), or None."""
    for attr, words in MODULE_HOOK_DICTS.items():
        if source.endswith("." + attr):
            return words
    return None
