"""Shipped C++ kernels: the shared objects Inductor built, read from its code cache
when its compile returns (``lean_writer`` keeps them in the artifact), and loaded
on PyTorch's full path in place of Inductor's compiles.

The kernels' private directory and the loader of one shipped kernel are the lean
runtime's (:mod:`.lean.kernels`); this module patches Inductor's code cache to use them."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..lean import KernelLoader, kernel_dir, kernel_key

log = logging.getLogger("torch_precompile")


def built_kernel_binary(argtypes: list[str], source: str) -> bytes:
    """The shared object Inductor built for a C++ kernel, from its code cache: a hit
    right after the compile that built it (or found it on disk); built on a miss."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
    with open(kernel.__self__.__file__, "rb") as f:
        return f.read()


# ------------------------------------- shipped CPU kernels on PyTorch's full path
# Artifacts that do not take the lean path (dynamic shapes, training, closures,
# variants) load through PyTorch's deserialization, which re-creates Inductor's
# wrapper modules; each wrapper asks ``CppPythonBindingsCodeCache`` for its C++
# kernels, which compiles them on a cache miss. The artifact's kernel sections
# carry the shared objects built at save; while a compiled function is
# deserialized, a kernel whose key is among them is loaded from the shipped file.


def compiled_graph_sources(fn: Any) -> list[str]:
    """The Inductor wrapper source of each compiled graph (forward, backward) of ``fn``."""
    entry = fn._artifacts.compiled_fn.compiled_fn.serialize()
    sources = []
    for part in (entry.compiled_fw, getattr(entry, "compiled_bw", None)):
        graph = getattr(part, "result", None)
        source = getattr(graph, "source_code", None)
        if source:
            sources.append(source)
    return sources


def kernel_file_without_compiling(argtypes: list[str], source: str) -> str | None:
    """The ``.so`` of a kernel that Inductor built (or found on disk) in this process.

    A cache miss must not start a compile at save: C++ builds are refused while
    looking up (the miss then reads as None). Inductor's first compile of a
    process probes the CPU's vector ISA with a test build. Kernels built in
    compile workers (a machine with many cores) leave that probe unrun in this
    process: it runs here first, unrefused (refusing its build would cache a
    wrong ISA), so that the lookup finds the worker's ``.so`` by the same key.
    """
    from torch._inductor import cpp_builder, cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.exc import InvalidCxxCompiler

    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        try:
            cpu_vec_isa.pick_vec_isa()
        except (InvalidCxxCompiler, OSError):  # no compiler here: nothing to find
            return None

    class _WouldCompile(Exception):
        pass

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _WouldCompile(self.get_target_file_path())

    original = cpp_builder.CppBuilder.build
    cpp_builder.CppBuilder.build = refuse  # type: ignore[method-assign]
    try:
        kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
        return kernel.__self__.__file__
    except _WouldCompile:
        return None
    finally:
        cpp_builder.CppBuilder.build = original  # type: ignore[method-assign]


def shipped_kernels_enabled() -> bool:
    """``TORCH_PRECOMPILE_SHIPPED_KERNELS=0`` makes the full path compile every kernel."""

    return os.environ.get("TORCH_PRECOMPILE_SHIPPED_KERNELS", "1") != "0"


@contextlib.contextmanager
def _pybindings_from(lookup: Callable[[str, list[str], str], Any]) -> Iterator[None]:
    """Inductor's ``CppPythonBindingsCodeCache`` asks ``lookup(key, argtypes, source)``
    first; a kernel it returns is used as is, None compiles (or hits the cache) as before.

    Only this class's ``load_pybinding_async`` (what the wrapper's
    ``async_compile.cpp_pybinding`` and ``load_pybinding`` call) is patched, for
    the duration of the block.
    """
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    previous = CppPythonBindingsCodeCache.__dict__["load_pybinding_async"]

    def load_pybinding_async(cls: Any, argtypes: Any, main_code: str, *a: Any, **kw: Any) -> Any:
        # Subclasses append another binding suffix: only the plain class's kernels match.
        if cls is CppPythonBindingsCodeCache and not a and set(kw) <= {"submit_fn"}:
            kernel = lookup(kernel_key(argtypes, main_code), list(argtypes), main_code)
            if kernel is not None:
                return lambda: kernel
        return previous.__func__(cls, argtypes, main_code, *a, **kw)

    CppPythonBindingsCodeCache.load_pybinding_async = classmethod(load_pybinding_async)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CppPythonBindingsCodeCache.load_pybinding_async = previous  # type: ignore[method-assign]


@contextlib.contextmanager
def shipped_cpp_kernels(kernels: Mapping[str, bytes | memoryview] | None) -> Iterator[None]:
    """While active, Inductor loads the shipped kernels instead of compiling them.

    A kernel whose key is in ``kernels`` is written to the artifact's private
    directory and imported as the lean path does; any other kernel compiles as
    before. A shipped kernel that cannot be written or loaded raises
    :class:`KernelDirectoryError` rather than compiling it. PyTorch loads both
    the forward and the backward wrapper while deserializing, so the patch
    lasts for that call only.
    """
    if not kernels or not shipped_kernels_enabled():
        yield
        return

    directory: list[str] = []  # made on the first shipped kernel asked for
    guards_c = torch._C._dynamo.guards  # type: ignore[attr-defined]
    data_ptr = str(guards_c._torchinductor_pyobject_tensor_data_ptr)

    def lookup(key: str, argtypes: list[str], source: str) -> Any:
        if key not in kernels:
            log.debug("kernel %s is not shipped: compiling it", key[:12])
            return None
        # No fallback to compiling: a kernel directory that cannot hold or map the
        # kernels raises KernelDirectoryError, which says how to choose another.
        if not directory:
            directory.append(kernel_dir(kernels))
        return KernelLoader(kernels, directory[0], data_ptr).cpp_pybinding(argtypes, source)

    with _pybindings_from(lookup):
        yield
