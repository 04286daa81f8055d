"""Fast loading of CPU inference artifacts: shipped kernels, no compiler, no Inductor.

A CPU artifact saved in the process that compiled it carries two extra sections:

- ``kernels``: the shared objects Inductor built for the graph's C++ kernels
  (the ``.so`` files of its code cache), keyed by a digest of each kernel's
  source;
- ``fastload``: what is needed to run the compiled graph without PyTorch's
  compiler stack: Inductor's generated Python wrapper (``call(args)``),
  Dynamo's transformed bytecode (which reads the graph inputs off ``self`` and
  rebuilds the outputs), its globals, the signature and the guard state.

Loading then writes the shared objects into a private directory, ``dlopen``\\ s
them and executes the wrapper with light stand-ins for the few Inductor names
it imports (``AsyncCompile``, ``extern_kernels``, ...). No C++ compiler runs,
``TORCHINDUCTOR_CACHE_DIR`` is not read, and neither ``torch._inductor``'s
compiler nor AOTAutograd is imported. Guards are checked by a plain-Python
translation of Dynamo's guard tree (``_compat.LightGuards``); Dynamo's own
guard manager (which imports ``torch._dynamo``) is built only when that check
fails or the tree could not be translated (symbolic sizes, for one). The saved
code was checked at save time to be one of the plain cases this runner handles
(inference, CPU, no input mutation, no output aliasing an input); dynamic
shapes are among them, since Inductor's wrapper reads the sizes off its
inputs. Any other artifact, or any failure here, loads through PyTorch's full
path. Every CPU
artifact carries the ``kernels`` section (a bundle of variants: the union of
their forward and backward kernels), and the full path loads its kernels from
there too (``_compat.shipped_cpu_kernels``) instead of compiling them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import pickle
import stat
import struct
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import profiler as _profiler_state

log = logging.getLogger("torch_precompile")

FASTLOAD_VERSION = 1
ALIGNMENT = 16  # bytes; what Inductor assumes of inputs listed in ``inputs_to_check``
_ALIGN_BYTES = 64  # Inductor's memory planning pool alignment


def kernel_key(argtypes: Sequence[str], source_code: str) -> str:
    """Digest naming one C++ kernel: its argument types and source."""
    h = hashlib.sha256()
    h.update(json.dumps(list(argtypes)).encode())
    h.update(b"\0")
    h.update(source_code.encode())
    return h.hexdigest()


# ------------------------------------------------------------ kernels section


def pack_kernels(binaries: dict[str, bytes]) -> bytes:
    """``u64 index length | index JSON {key: [offset, length]} | bytes``."""
    index: dict[str, list[int]] = {}
    offset = 0
    for key, data in binaries.items():
        index[key] = [offset, len(data)]
        offset += len(data)
    head = json.dumps(index, sort_keys=True).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(binaries.values())


def unpack_kernels(data: bytes) -> dict[str, memoryview]:
    (n,) = struct.unpack_from("<Q", data, 0)
    index = json.loads(bytes(data[8 : 8 + n]))
    view = memoryview(data)[8 + n :]
    return {key: view[off : off + length] for key, (off, length) in index.items()}


def _kernel_dir(kernels_section: bytes) -> str:
    """A private directory for this artifact's shared objects (content-addressed).

    Shared objects are loaded from it, so it must be ours alone: a directory
    another user owns or can write to is never used (a fresh one is made).
    """
    digest = hashlib.sha256(kernels_section).hexdigest()[:24]
    user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    root = os.path.join(tempfile.gettempdir(), f"torch_precompile-{user}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        path = os.path.join(root, digest)
        os.makedirs(path, mode=0o700, exist_ok=True)
        if _private(root) and _private(path):
            os.utime(path)  # in use: pruning goes by this time
            _prune_kernel_dirs(root, keep=digest)
            return path
    except OSError:
        pass
    log.warning("%s is not private to this user; using a fresh temporary directory", root)
    return tempfile.mkdtemp(prefix="torch_precompile-")


KERNEL_DIR_MAX_AGE_S = 14 * 24 * 3600


def _prune_kernel_dirs(root: str, keep: str, max_age_s: float = KERNEL_DIR_MAX_AGE_S) -> None:
    """Remove other artifacts' kernel directories unused for ``max_age_s`` (best effort).

    Each load marks its directory as used, so only directories no artifact
    loaded for two weeks go. A process still running such kernels keeps them:
    Linux keeps a loaded shared object mapped after its file is removed.
    """
    import shutil
    import time

    cutoff = time.time() - max_age_s
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            if (
                entry.name != keep
                and entry.is_dir(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_mtime < cutoff
            ):
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue


def _private(path: str) -> bool:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        return False
    return not hasattr(os, "getuid") or st.st_uid == os.getuid()


def _materialize(directory: str, key: str, data: memoryview) -> str:
    """Write one shared object unless an identical file is already there."""
    path = os.path.join(directory, f"k{key[:40]}.so")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return path
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


class _KernelLoader:
    """Stands in for Inductor's ``AsyncCompile`` in the generated wrapper.

    ``cpp_pybinding(argtypes, source)`` returns the ``kernel`` function of the
    shipped shared object built from that source, exactly what Inductor's
    ``CppPythonBindingsCodeCache`` returns after compiling it.
    """

    def __init__(self, kernels: dict[str, memoryview], directory: str, data_ptr_env: str) -> None:
        self._kernels = kernels
        self._directory = directory
        self._data_ptr_env = data_ptr_env

    def __call__(self) -> _KernelLoader:  # the wrapper does ``async_compile = AsyncCompile()``
        return self

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        key = kernel_key(argtypes, source_code)
        if key not in self._kernels:
            raise KeyError(f"kernel {key[:12]} is not among the artifact's shipped kernels")
        path = _materialize(self._directory, key, self._kernels[key])
        # The bindings read this at import to find torch's tensor data_ptr helper.
        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = self._data_ptr_env
        name = f"torch_precompile_k{key[:40]}.kernel"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load kernel {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
        return module.kernel

    def wait(self, scope: dict[str, Any]) -> None:
        pass  # kernels are loaded synchronously


class _ExternKernels:
    """Stands in for ``torch._inductor.select_algorithm.extern_kernels``.

    Save checked that each name the wrapper uses is the public ``torch``
    function of that name (``torch.addmm``, ``torch.mm``, ...).
    """

    def __init__(self, names: Sequence[str]) -> None:
        for name in names:
            setattr(self, name, getattr(torch, name))


def _align(nbytes: int) -> int:
    return (nbytes + _ALIGN_BYTES - 1) & -_ALIGN_BYTES


def _run_intermediate_hooks(name: str, val: Any) -> None:
    pass  # save refuses wrappers that call it


def _maybe_profile(should_profile: bool, *args: Any, **kwargs: Any) -> Any:
    import contextlib

    return contextlib.nullcontext()


# Import lines of Inductor's wrapper, and the name each binds (save checks that
# the wrapper imports nothing else from torch._inductor).
WRAPPER_IMPORTS: dict[str, str] = {
    "from torch._inductor.hooks import run_intermediate_hooks": "run_intermediate_hooks",
    "from torch._inductor.utils import maybe_profile": "maybe_profile",
    "from torch._inductor.codegen.memory_planning import _align as align": "align",
    "from torch._inductor.async_compile import AsyncCompile": "AsyncCompile",
    "from torch._inductor.select_algorithm import extern_kernels": "extern_kernels",
}


def strip_wrapper_imports(source: str) -> str:
    """The wrapper without its ``torch._inductor`` imports (they are injected)."""
    lines = source.splitlines()
    return "\n".join("" if line.strip() in WRAPPER_IMPORTS else line for line in lines)


def wrapper_inductor_imports(source: str) -> list[str]:
    """Top-level lines importing from ``torch._inductor`` that we cannot stand in for."""
    main = source.split('\nif __name__ == "__main__":', 1)[0]
    bad = []
    for line in main.splitlines():
        if line.startswith((" ", "\t")):
            continue  # function-local imports (benchmark helpers) never run
        stripped = line.strip()
        if "torch._inductor" in stripped and stripped not in WRAPPER_IMPORTS:
            bad.append(stripped)
    return bad


def _clone_preserve_strides(x: torch.Tensor) -> torch.Tensor:
    if 0 in x.size():
        needed = 0
    else:
        needed = sum((size - 1) * stride for size, stride in zip(x.size(), x.stride())) + 1
    buffer = torch.as_strided(x, (needed,), (1,)).clone()
    return torch.as_strided(buffer, x.size(), x.stride())


class _GraphCall:
    """The compiled graph with Dynamo's calling convention: ``fn(*graph_inputs)``."""

    def __init__(self, call: Callable[[list[Any]], Any], inputs_to_check: Sequence[int]) -> None:
        self._call = call
        self._inputs_to_check = tuple(inputs_to_check)

    def __call__(self, *args: Any) -> Any:
        inputs = list(args)
        for i in self._inputs_to_check:
            t = inputs[i]
            if t.data_ptr() % ALIGNMENT:
                inputs[i] = _clone_preserve_strides(t)
        return self._call(inputs)


def build_graph_call(
    wrapper_source: str,
    extern_names: Sequence[str],
    inputs_to_check: Sequence[int],
    kernels_section: bytes,
    data_ptr_env: str,
    filename: str,
) -> _GraphCall:
    """Execute Inductor's wrapper with the shipped kernels; returns its ``call``."""
    kernels = unpack_kernels(kernels_section)
    loader = _KernelLoader(kernels, _kernel_dir(kernels_section), data_ptr_env)
    module = types.ModuleType("torch_precompile_wrapper")
    module.__file__ = filename
    namespace = module.__dict__
    namespace.update(
        {
            "run_intermediate_hooks": _run_intermediate_hooks,
            "maybe_profile": _maybe_profile,
            "align": _align,
            "AsyncCompile": loader,
            "extern_kernels": _ExternKernels(extern_names),
        }
    )
    code = compile(strip_wrapper_imports(wrapper_source), filename, "exec")
    exec(code, namespace)  # generated code shipped in the (trusted) artifact
    return _GraphCall(namespace["call"], inputs_to_check)


class _DynamoUtils:
    """``torch._dynamo.utils`` as Dynamo's bytecode uses it, without importing Dynamo.

    The bytecode brackets its pre-graph work with two profiler markers; any
    other name is taken from the real module (imported on first use).
    """

    @staticmethod
    def record_pregraph_bytecode_enter() -> Any:
        if not _profiler_state._is_profiler_enabled:
            return None  # the common case: nothing to record, nothing to allocate
        cm = torch._C._profiler._RecordFunctionFast("Pregraph bytecode")
        cm.__enter__()
        return cm

    @staticmethod
    def record_pregraph_bytecode_exit(cm: Any) -> None:
        if cm is not None:
            cm.__exit__(None, None, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo.utils"), name)


def bytecode_function(
    spec: dict[str, Any], graph_call: _GraphCall, module_globals: dict[str, Any] | None = None
) -> types.FunctionType:
    """Dynamo's transformed bytecode as a function, with the graph bound to its backend name."""
    import marshal

    f_globals: dict[str, Any] = {
        alias: _DynamoUtils()
        if module_name == "torch._dynamo.utils"
        else importlib.import_module(module_name)
        for alias, module_name in spec["import_sources"].items()
    }
    f_globals.update(pickle.loads(spec["used_globals"]))
    f_globals.update(module_globals or {})  # e.g. an output dataclass, as PyTorch's path does
    f_globals["__builtins__"] = __builtins__
    f_globals[spec["backend_id"]] = graph_call
    code = marshal.loads(spec["bytecode"])
    fn = types.FunctionType(code, f_globals, code.co_name, spec["argdefs"], None)
    if spec["kwdefaults"]:
        fn.__kwdefaults__ = spec["kwdefaults"]
    return fn
