"""The lean runtime: a saved artifact run without Dynamo, AOTAutograd or Inductor.

``_compat/`` holds two kinds of code, and this subpackage is the boundary
between them:

- **save-time adapters** (``_compat/*.py``): thin code that reads PyTorch's
  compiled objects (Dynamo's capture and guards, AOTAutograd's cache entry,
  Inductor's compiled graphs and code cache) and writes what an artifact
  keeps. They import the compiler, and change when its private APIs change.
- **the lean runtime** (``_compat/lean/``, here): what runs at load in place of
  PyTorch's runtime machinery, re-implemented from the saved data alone:
  Inductor's generated wrapper with light stand-ins and the shipped kernels
  (``wrapper``, ``kernels``), Triton kernels launched by PyTorch's static CUDA
  launcher (``triton_kernels``), AOTAutograd's runtime wrappers (``runtime``
  for inference, ``autograd`` for training), CUDA graph recording for
  ``mode="reduce-overhead"`` (``cudagraphs``), Dynamo's guard tree as a
  plain-Python check (``guards``, ``guard_types``), and the loader that
  assembles them (``load``). Nothing here imports ``torch._dynamo``,
  ``torch._inductor``, AOTAutograd or sympy at module level; inside a
  function, only the save-time functions below do, and Dynamo's own guard
  manager (built from its saved state) when the lean check cannot decide.

It stays under ``_compat/`` because it still touches private ``torch`` names
(``torch._C._dynamo.guards``, the static CUDA launcher, listed in
``contract.py`` like the rest). A PyTorch upgrade that changes a runtime
detail is this folder's work; one that changes a compiled object's structure
is the adapters' work.

Each runtime module also defines its spec (a dataclass stored with
``dataclasses.asdict``, never pickled as a class) and the save-time function
that decides from PyTorch's compiled objects whether the runtime can run an
artifact and writes that spec (``inference_refusal``, ``autograd_refusal``,
``cudagraph_spec``, ``triton_sections``, ``wrapper_refusal``): what the
runtime handles is written once, beside the code that handles it. Those
functions are called only by the save-time adapters (``_compat/lean_sections.py``).

This ``__init__`` is the one interface: the rest of the package and the
save-time adapters use the names below, never the modules inside.
Its imports are two shared helpers of ``_compat/`` that import no compiler:
``pickling`` (code objects) and ``bytecode_globals`` (the saved bytecode's
function and globals).
"""

from .autograd import AUTOGRAD_SPEC_VERSION, AutogradSpec, autograd_refusal
from .cudagraphs import cudagraph_spec
from .guard_types import LEAN_TYPES, frame_local, named_class, shape_expr_ok
from .guards import hook_guards_enabled
from .kernels import KernelLoader, kernel_dir, kernel_key
from .load import LEAN_SECTION_VERSION, LeanCompiledFunction, load_lean_compiled_function
from .runtime import RUNTIME_SPEC_VERSION, InferenceSpec, inference_refusal
from .subclasses import (
    SUBCLASS_SPEC_VERSION,
    SubclassSpec,
    bound_mesh,
    current_mesh,
    subclass_refusal,
)
from .triton_kernels import triton_sections
from .wrapper import recorded_calls, recorded_kernels, wrapper_refusal

__all__ = [
    "AUTOGRAD_SPEC_VERSION",
    "LEAN_SECTION_VERSION",
    "LEAN_TYPES",
    "RUNTIME_SPEC_VERSION",
    "SUBCLASS_SPEC_VERSION",
    "AutogradSpec",
    "InferenceSpec",
    "KernelLoader",
    "LeanCompiledFunction",
    "SubclassSpec",
    "autograd_refusal",
    "bound_mesh",
    "cudagraph_spec",
    "current_mesh",
    "frame_local",
    "hook_guards_enabled",
    "inference_refusal",
    "kernel_dir",
    "kernel_key",
    "load_lean_compiled_function",
    "named_class",
    "recorded_calls",
    "recorded_kernels",
    "shape_expr_ok",
    "subclass_refusal",
    "triton_sections",
    "wrapper_refusal",
]
