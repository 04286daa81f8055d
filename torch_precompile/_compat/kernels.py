"""Shipped C++ kernels: their private directory, and loading them in place of
Inductor's compiles on PyTorch's full path.

An artifact ships each kernel's shared object as one file section; here the
kernels are a mapping ``{key: bytes}`` (:func:`kernel_key` names a kernel by its
argument types and source), whatever the file layout."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .._errors import KernelDirectoryError

log = logging.getLogger("torch_precompile")


def kernel_key(argtypes: Sequence[str], source_code: str) -> str:
    """Digest naming one C++ kernel: its argument types and source."""
    h = hashlib.sha256()
    h.update(json.dumps(list(argtypes)).encode())
    h.update(b"\0")
    h.update(source_code.encode())
    return h.hexdigest()


KERNEL_DIR_ENV = "TORCH_PRECOMPILE_KERNEL_DIR"
_DIGEST_NAME = re.compile(r"[0-9a-f]{24}")


def kernel_root() -> str:
    """Where artifacts' kernel directories live: ``$TORCH_PRECOMPILE_KERNEL_DIR`` if set,
    else ``torch_precompile-<uid>`` in the system temp directory."""
    configured = os.environ.get(KERNEL_DIR_ENV)
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"torch_precompile-{user}")


def kernel_dir(kernels: Mapping[str, bytes | memoryview]) -> str:
    """A private directory for this artifact's shared objects (content-addressed).

    Shared objects are loaded from it, so it must be ours alone, and the
    filesystem must let us map them as code. Anything else raises
    :class:`KernelDirectoryError` naming the directory, the cause and the fix;
    no other directory is made in its place (a fresh one per load would pile
    up), and the caller never falls back to compiling.
    """
    digest = _kernels_digest(kernels)
    root = kernel_root()
    path = os.path.join(root, digest)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        _check_private(root)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode=0o700)
        _check_private(path)
        _check_exec(path)
        os.utime(path)  # in use: pruning goes by this time
    except OSError as exc:
        raise KernelDirectoryError(getattr(exc, "filename", None) or root, _os_cause(exc)) from exc
    _prune_kernel_dirs(root, keep=digest)
    return path


def _kernels_digest(kernels: Mapping[str, bytes | memoryview]) -> str:
    """Names the directory of one set of kernels: their keys and bytes, in key order."""
    h = hashlib.sha256()
    for key in sorted(kernels):
        data = kernels[key]
        h.update(key.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:24]


def _os_cause(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return f"the filesystem is full ({exc.strerror})"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"it is not writable ({exc.strerror})"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"it is missing and cannot be made ({exc.strerror})"
    return f"{type(exc).__name__}: {exc.strerror or exc}"


KERNEL_DIR_MAX_AGE_S = 14 * 24 * 3600


def _prune_kernel_dirs(root: str, keep: str, max_age_s: float = KERNEL_DIR_MAX_AGE_S) -> None:
    """Remove other artifacts' kernel directories unused for ``max_age_s`` (best effort).

    Each load marks its directory as used, so only directories no artifact
    loaded for two weeks go. A process still running such kernels keeps them:
    Linux keeps a loaded shared object mapped after its file is removed. Only
    names of our shape (24 hex digits) are touched: ``TORCH_PRECOMPILE_KERNEL_DIR``
    may name a directory that holds other things.
    """

    cutoff = time.time() - max_age_s
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            if (
                entry.name != keep
                and _DIGEST_NAME.fullmatch(entry.name)
                and entry.is_dir(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_mtime < cutoff
            ):
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue


def _check_private(path: str) -> None:
    """A directory of this user that no one else can write to, not a link; else the error."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise KernelDirectoryError(path, "it is not a directory (a file or a symbolic link)")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelDirectoryError(
            path,
            f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): shared "
            "objects loaded from it would run another user's code; remove it if it is stale",
        )
    if st.st_mode & 0o022:
        raise KernelDirectoryError(
            path,
            f"its mode {stat.S_IMODE(st.st_mode):04o} lets group or others write to it "
            f"(chmod 700 {path} if it is yours)",
        )


def _check_exec(path: str) -> None:
    noexec = getattr(os, "ST_NOEXEC", 0)
    if noexec and hasattr(os, "statvfs") and os.statvfs(path).f_flag & noexec:
        raise KernelDirectoryError(
            path, "its filesystem is mounted noexec, so shared objects cannot be mapped from it"
        )


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Two threads importing one kernel module at once would both run its init.
_IMPORT_LOCK = threading.Lock()


def _materialize(directory: str, key: str, data: memoryview, suffix: str = ".so") -> str:
    """Write one shared object unless an identical file is already there.

    Threads and processes may materialise the same kernel at once: each writes
    its own temporary file (pid, thread and a random token in the name) and
    renames it over the target, so a reader sees a whole file or none. On any
    failure the temporary file is removed.
    """
    path = os.path.join(directory, f"k{key[:40]}{suffix}")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return path
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise KernelDirectoryError(directory, _os_cause(exc)) from exc
        raise
    return path


class KernelLoader:
    """Stands in for Inductor's ``AsyncCompile`` in the generated wrapper.

    ``cpp_pybinding(argtypes, source)`` returns the ``kernel`` function of the
    shipped shared object built from that source, exactly what Inductor's
    ``CppPythonBindingsCodeCache`` returns after compiling it.
    """

    def __init__(
        self, kernels: Mapping[str, bytes | memoryview], directory: str, data_ptr_env: str
    ) -> None:
        self._kernels = kernels
        self._directory = directory
        self._data_ptr_env = data_ptr_env

    def __call__(self) -> KernelLoader:  # the wrapper does ``async_compile = AsyncCompile()``
        return self

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        key = kernel_key(argtypes, source_code)
        if key not in self._kernels:
            raise KeyError(f"kernel {key[:12]} is not among the artifact's shipped kernels")
        path = _materialize(self._directory, key, self._kernels[key])
        # The bindings read this at import to find torch's tensor data_ptr helper.
        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = self._data_ptr_env
        name = f"torch_precompile_k{key[:40]}.kernel"
        with _IMPORT_LOCK:
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot load kernel {path}")
                try:
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                except ImportError as exc:
                    # dlopen refused the file: a noexec or otherwise restricted
                    # filesystem (a corrupt file fails the artifact's checksums first).
                    raise KernelDirectoryError(
                        self._directory, f"the shared object {path} cannot be loaded ({exc})"
                    ) from exc
                sys.modules[name] = module
        return module.kernel

    def wait(self, scope: dict[str, Any]) -> None:
        pass  # kernels are loaded synchronously


# ------------------------------------- shipped CPU kernels on PyTorch's full path
# Artifacts that do not take the fast path (dynamic shapes, training, closures,
# variants) load through PyTorch's deserialization, which re-creates Inductor's
# wrapper modules; each wrapper asks ``CppPythonBindingsCodeCache`` for its C++
# kernels, which compiles them on a cache miss. The artifact's kernel sections
# carry the shared objects built at save; while a compiled function is
# deserialized, a kernel whose key is among them is loaded from the shipped file.

SHIPPED_KERNELS: dict[str, Any] = {}  # kernel key -> shipped kernel loaded in this process


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
    process probes the CPU's vector ISA with a test build; if that probe never
    ran here, nothing was compiled in this process and the lookup is skipped
    (refusing the probe's build would cache a wrong ISA).
    """
    from torch._inductor import cpp_builder, cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
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
def shipped_cpu_kernels(kernels: Mapping[str, bytes | memoryview] | None) -> Iterator[None]:
    """While active, Inductor loads the shipped kernels instead of compiling them.

    A kernel whose key is in ``kernels`` is written to the artifact's private
    directory and imported as the fast path does; any other kernel compiles as
    before. A shipped kernel that cannot be written or loaded raises
    :class:`KernelDirectoryError` rather than compiling it. PyTorch loads both
    the forward and the backward wrapper while deserializing, so the patch
    lasts for that call only.
    """
    if not kernels or not shipped_kernels_enabled():
        yield
        return

    log = logging.getLogger("torch_precompile")
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
        loader = KernelLoader(kernels, directory[0], data_ptr)
        kernel = loader.cpp_pybinding(argtypes, source)
        SHIPPED_KERNELS[key] = kernel
        return kernel

    with _pybindings_from(lookup):
        yield


@contextlib.contextmanager
def reusing_shipped_kernels() -> Iterator[None]:
    """Kernels this process loaded from artifacts are found as if Inductor had built
    them: saving an artifact loaded through the full path reads them, never compiles."""
    if not SHIPPED_KERNELS:
        yield
        return
    with _pybindings_from(lambda key, argtypes, source: SHIPPED_KERNELS.get(key)):
        yield
