"""Shipped C++ kernels at load: their private directory, and loading them without a compiler.

An artifact ships each kernel's shared object as one file section; here the
kernels are a mapping ``{key: bytes}`` (:func:`kernel_key` names a kernel by its
argument types and source), whatever the file layout. PyTorch's full path loads
them through ``_compat/codecache.py`` (:func:`shipped_cpp_kernels`), with the
:class:`KernelLoader` defined here. A load writes every kernel's file (shared
objects, and Triton cubins for ``triton_kernels.py``) on a thread while it goes on
(:func:`files_ahead`), so a graph's loader finds them there."""

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
# A kernel's file is named by its kind: what the loaders pass, what files_ahead writes.
SHARED_OBJECT, CUBIN = ".so", ".cubin"
SUFFIXES = (CUBIN, SHARED_OBJECT)
EM_CUDA = 190  # the ELF machine of a CUDA binary (a Triton cubin)
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
    made = False
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        _check_private(root)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode=0o700)
            made = True
        _check_private(path)
        _check_exec(path)
        os.utime(path)  # in use: pruning goes by this time
    except OSError as exc:
        raise KernelDirectoryError(getattr(exc, "filename", None) or root, _os_cause(exc)) from exc
    if made:  # the root grows only here: prune then, not at every load (a stat a directory)
        _prune_kernel_dirs(root, keep=digest)
    return path


def _kernels_digest(kernels: Mapping[str, bytes | memoryview]) -> str:
    """Names the directory of one set of kernels: their keys and SHA-256s, in key order."""
    h = hashlib.sha256()
    for key in sorted(kernels):
        h.update(key.encode())
        h.update(kernel_sha256(kernels, key).encode())
    return h.hexdigest()[:24]


def kernel_sha256(kernels: Mapping[str, bytes | memoryview], key: str) -> str:
    """The SHA-256 of kernel ``key``: from the checked header when ``kernels`` knows it
    (an artifact file's kernels, read lazily), else from its bytes."""
    known = getattr(kernels, "sha256", None)
    return known(key) if known is not None else hashlib.sha256(kernels[key]).hexdigest()


def _kernel_length(kernels: Mapping[str, bytes | memoryview], key: str) -> int:
    known = getattr(kernels, "length", None)
    return known(key) if known is not None else memoryview(kernels[key]).nbytes


def kernel_file(
    directory: str, key: str, kernels: Mapping[str, bytes | memoryview], suffix: str = SHARED_OBJECT
) -> str:
    """The file of kernel ``key`` in ``directory`` (:func:`kernel_dir`), written if absent.

    The directory is private, named by the SHA-256 of every kernel it holds, and
    a file appears in it only whole (renamed into place): a file of the right
    length there already holds this kernel, which is then not read at all.
    """
    path = _kernel_path(directory, key, suffix)
    if _present(path, kernels, key):
        return path
    return _materialize(directory, key, memoryview(kernels[key]), suffix)


def _present(path: str, kernels: Mapping[str, bytes | memoryview], key: str) -> bool:
    """Whether ``path`` holds kernel ``key`` already (a whole file of its length)."""
    try:
        return os.stat(path).st_size == _kernel_length(kernels, key)
    except OSError:
        return False


def _kernel_path(directory: str, key: str, suffix: str) -> str:
    return os.path.join(directory, f"k{key[:40]}{suffix}")


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


def _materialize(directory: str, key: str, data: memoryview, suffix: str = SHARED_OBJECT) -> str:
    """Write one shared object unless an identical file is already there.

    Threads and processes may materialise the same kernel at once: each writes
    its own temporary file (pid, thread and a random token in the name) and
    renames it over the target, so a reader sees a whole file or none. On any
    failure the temporary file is removed.
    """
    path = _kernel_path(directory, key, suffix)
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


def kernel_suffix(data: bytes | memoryview) -> str:
    """The file suffix the loaders give kernel ``data``: ``.cubin`` for a CUDA ELF
    binary (its ``e_machine``), ``.so`` for a shared object."""
    head = bytes(memoryview(data)[:20])
    cuda = head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == EM_CUDA
    return CUBIN if cuda else SHARED_OBJECT


@contextlib.contextmanager
def files_ahead(kernels: Mapping[str, bytes | memoryview]) -> Iterator[None]:
    """Write every kernel's file (:func:`kernel_file`) on a thread while the load goes
    on; waited for on exit.

    A graph's loader then finds its kernels' files already there and reads none
    (on an H200, writing them took half of a generator's kernel loading). A kernel
    the loader asks for first it writes itself; both rename a whole file into
    place, so either copy is the kernel. A failure stops the thread quietly: the
    loader meets it again and raises :class:`KernelDirectoryError` as before.
    """
    if not kernels:
        yield
        return

    def write_all() -> None:
        try:
            directory = kernel_dir(kernels)
            for key in kernels:
                paths = (_kernel_path(directory, key, suffix) for suffix in SUFFIXES)
                if not any(_present(path, kernels, key) for path in paths):
                    data = memoryview(kernels[key])
                    _materialize(directory, key, data, kernel_suffix(data))
        except Exception as exc:  # the loader meets it again, and says so
            log.debug("writing kernel files ahead stopped: %s: %s", type(exc).__name__, exc)

    thread = threading.Thread(target=write_all, name="torch_precompile-kernel-files", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


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
        path = kernel_file(self._directory, key, self._kernels)
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
