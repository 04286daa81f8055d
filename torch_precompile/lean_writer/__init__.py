"""The lean format's writer: what an artifact needs to run without the compiler,
read from what the compiler built, beside its reader (:mod:`..lean`).

Where :mod:`..lean` may import no compiler, this folder reads the compiler's
products, at the moment each is made:

- ``sections``: the C++ kernels' shared objects as Inductor's compile returns
  (:func:`kept_kernels`; the artifact owns them), and at save the ``lean``
  section of a compiled function (:func:`lean_sections`) and the kernels of
  the full path (:func:`cpp_kernels`);
- ``specs``: what the lean runtime can run (AOTAutograd's runtime metadata,
  Inductor's wrapper, CUDA graphs, tensor subclasses) as plain specs;
- ``triton_cubins``: the Triton kernels' cubins and launch parameters;
- ``guard_spec``: Dynamo's guard tree read at precompile into a plain spec
  (:func:`read_lean_guards`), from its typed sources, guards and the capture's
  live values (never its debug text); ``guard_leaves``: one reader per kind of
  leaf guard; ``dtensor_guards``: the same for DTensor and DeviceMesh guards.

It touches private ``torch`` names, as ``_compat/`` and ``lean/`` do; every one
is listed in ``_compat/contract.py``.
"""

from .guard_spec import read_lean_guards
from .lean_sections import cpp_kernels, kept_kernels, lean_sections

__all__ = ["cpp_kernels", "kept_kernels", "lean_sections", "read_lean_guards"]
