"""The lean runtime: a saved artifact run without Dynamo, AOTAutograd or Inductor.

What runs at load in place of PyTorch's runtime machinery, rebuilt from the
saved data alone: Inductor's generated wrapper with light stand-ins and the
shipped kernels (``wrapper``, ``kernels``), Triton kernels launched by
PyTorch's static CUDA launcher (``triton_kernels``), AOTAutograd's runtime
wrappers (``inference``, ``autograd`` for training, ``subclasses``
for DTensor inputs), CUDA graph recording for ``mode="reduce-overhead"``
(``cudagraphs``), Dynamo's guard tree as a plain-Python check (``guards``,
``guard_emit``, ``guard_types``), the saved bytecode's globals and code objects
(``bytecode_globals``, ``pickling``), and the loader that assembles them
(``compiled_function``).

The rule of this folder, kept by ``tests/test_layout.py``: it imports nothing
of the package above ``file/`` (no stage, no save-time adapter of
``_compat/``), and no compiler: not ``torch._inductor`` (its ``runtime``
subpackage aside, which generated code imports too), not AOTAutograd, not
sympy. The one exception is Dynamo's own guard manager, rebuilt from its
saved state when the lean guards refuse a call (``dynamo_fallback.load_dynamo_guard_manager``,
``dynamo_fallback.hook_guards_enabled``, ``compiled_function.LeanCompiledFunction.__call__``): it
imports ``torch._dynamo``, never a compiler.

The format's schema is ``schema`` (the section, the runtime specs, the Triton
launches) and ``guard_schema`` (the guard tree): one frozen dataclass per record,
its ``write`` and ``read`` side by side; the writer (``lean_writer/``) builds
them, this folder reads them. The save-time functions that read PyTorch's
compiled objects into those records live in ``lean_writer/specs.py``,
``lean_writer/triton_cubins.py`` and ``lean_writer/guard_spec.py``. This
folder touches private ``torch`` names (the static CUDA launcher,
``torch._C._dynamo.guards``): each is listed in ``_compat/contract.py`` and
checked on the installed torch.

This ``__init__`` is the one interface: the rest of the package uses the
names below, never the modules inside.
"""

from .compiled_function import LeanCompiledFunction, load_lean_compiled_function
from .dynamo_fallback import hook_guards_enabled
from .guard_types import LEAN_TYPES, frame_local, named_class, shape_expr_ok
from .kernels import KernelLoader, files_ahead, kernel_dir, kernel_key
from .schema import (
    AutogradSpec,
    BackwardSection,
    CompiledPython,
    CUDAGraphSpec,
    InferenceSpec,
    LeanSection,
    SubclassSpec,
    TritonLaunch,
)
from .subclasses import bound_mesh, current_mesh

__all__ = [
    "LEAN_TYPES",
    "AutogradSpec",
    "BackwardSection",
    "CUDAGraphSpec",
    "CompiledPython",
    "InferenceSpec",
    "KernelLoader",
    "LeanCompiledFunction",
    "LeanSection",
    "SubclassSpec",
    "TritonLaunch",
    "bound_mesh",
    "current_mesh",
    "files_ahead",
    "frame_local",
    "hook_guards_enabled",
    "kernel_dir",
    "kernel_key",
    "load_lean_compiled_function",
    "named_class",
    "shape_expr_ok",
]
