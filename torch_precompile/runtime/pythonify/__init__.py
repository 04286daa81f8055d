"""``PrecompiledArtifact.to_python()``: the artifact's call path as a readable module.

:mod:`.support` is the small public surface the generated modules import.
"""

from ._generate import generate, write_module

__all__ = ["generate", "write_module"]
