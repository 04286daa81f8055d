"""A serving process's ``import torch`` without the parts of torch it never runs.

``import torch`` runs the bodies of some submodules that a process serving a
generator file never uses: the Python meta kernels (``torch._meta_registrations``,
for fake and meta tensors, that is for a compiler), ``torch.export``,
``torch.nested`` and ``torch.distributions``: 0.16 s of 0.77 on a 2-core AMD EPYC
(torch 2.13). :func:`import_torch` imports torch with each of them a module whose
body runs at its first use instead: an attribute it lacks, a submodule imported
under it, or the import of a compiler's module that needs them all
(:data:`NEEDED_BY`). Each is still ``torch.export`` and the rest, bound where
``import torch`` binds it, so code that uses one sees no difference but the time
of its import. What torch itself needs of their imports is imported at once
(:data:`REQUIRED`).

Only ``torch-precompile serve`` and ``generate`` defer (``torch_precompile_cli``),
and only when torch is not yet imported; the library itself never does.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

# Submodules whose bodies wait for their first use.
DEFERRED = (
    "torch._meta_registrations",
    "torch.export",
    "torch.nested",
    "torch.distributions",
)
# Modules that need every deferred body run before their own: the compiler's (its fake
# tensors need the meta kernels). ``import torch`` itself imports fake tensors, so
# those cannot be the mark.
NEEDED_BY = ("torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd")
# What the deferred bodies import that torch needs set up at once: the meta kernels
# import rng_prims, which makes torch.Generator an opaque type (torch.Generator()
# refuses to run before, torch 2.13).
REQUIRED = ("torch._prims.rng_prims",)
_LOADER = "_lean_torch_loader"


def import_torch() -> bool:
    """Import torch with :data:`DEFERRED`'s bodies deferred; False (and nothing done)
    where torch is already imported."""
    if "torch" in sys.modules:
        return False
    sys.meta_path.insert(0, _Finder())
    importlib.import_module("torch")
    for name in REQUIRED:
        if importlib.util.find_spec(name) is not None:  # where this torch has it
            importlib.import_module(name)
    return True


def run_deferred() -> list[str]:
    """Run every deferred body now (a no-op for those already run); the names run."""
    done = []
    for name in DEFERRED:
        module = sys.modules.get(name)
        if isinstance(module, _Deferred):
            _run(module)
            done.append(name)
    return done


class _Deferred(types.ModuleType):
    """A module whose body has not run: the first attribute it lacks runs it."""

    def __getattr__(self, name: str) -> Any:
        # The import system and ``inspect`` probe dunders of every module (torch's
        # custom-op registration reads them at import): answered without the body.
        if name.startswith("__") and name.endswith("__") and name != "__all__":
            raise AttributeError(name)
        _run(self)
        return getattr(self, name)


def _run(module: types.ModuleType) -> None:
    """Run a deferred module's body in place (once)."""
    loader = module.__dict__.pop(_LOADER, None)
    if loader is None:
        return
    module.__class__ = types.ModuleType
    module.__loader__ = loader
    if module.__spec__ is not None:
        module.__spec__.loader = loader
    loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Hands out deferred modules for :data:`DEFERRED`; runs their bodies where a
    submodule of one or a module of :data:`NEEDED_BY` is imported."""

    def __init__(self) -> None:
        self.names = frozenset(DEFERRED)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        parent = sys.modules.get(fullname.rpartition(".")[0])
        if isinstance(parent, _Deferred):
            _run(parent)  # a submodule may need what its package's body sets up
        if any(fullname == n or fullname.startswith(n + ".") for n in NEEDED_BY):
            self.names = frozenset()  # a compiler is coming: nothing is deferred from now
            run_deferred()
            return None
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    """Creates the module as its own loader would, and leaves its body for later."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def create_module(self, spec: Any) -> Any:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__class__ = _Deferred
        module.__dict__[_LOADER] = self.real
