"""Inductor's generated Python wrapper (``call(args)``): its imports, the kernels
it asks for, and running it with light stand-ins instead of Inductor."""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .kernels import KernelLoader, kernel_dir

ALIGNMENT = 16  # bytes; what Inductor assumes of inputs listed in ``inputs_to_check``
_ALIGN_BYTES = 64  # Inductor's memory planning pool alignment


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


class GraphCall:
    """The compiled graph with Dynamo's calling convention: ``fn(*graph_inputs)``."""

    def __init__(self, call: Callable[[list[Any]], Any], inputs_to_check: Sequence[int]) -> None:
        self._call = call
        self._inputs_to_check = tuple(inputs_to_check)

    def __call__(self, *args: Any) -> Any:
        return self.call_list(list(args))

    def call_list(self, inputs: list[Any]) -> Any:
        """Inductor's boxed convention: ``call`` takes (and empties) the list."""
        for i in self._inputs_to_check:
            t = inputs[i]
            if t.data_ptr() % ALIGNMENT:
                inputs[i] = _clone_preserve_strides(t)
        return self._call(inputs)


def build_graph_call(
    wrapper_source: str,
    extern_names: Sequence[str],
    inputs_to_check: Sequence[int],
    kernels: Mapping[str, bytes | memoryview],
    data_ptr_env: str,
    filename: str,
) -> GraphCall:
    """Execute Inductor's wrapper with the shipped kernels (``{key: shared object}``);
    returns its ``call``."""
    loader = KernelLoader(kernels, kernel_dir(kernels), data_ptr_env)
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
    return GraphCall(namespace["call"], inputs_to_check)


def wrapper_refusal(source: str) -> str | None:
    """Why Inductor's wrapper cannot run with the fast path's stand-ins (None if it can)."""

    bad = wrapper_inductor_imports(source)
    if bad:
        return f"the wrapper imports {bad[0]!r}"
    main = source.split('\nif __name__ == "__main__":', 1)[0]
    for name in ("run_intermediate_hooks", "maybe_profile"):
        if main.count(name) > 1:
            return f"the wrapper calls {name}"
    methods = set(re.findall(r"\basync_compile\.(\w+)", main))
    if methods - {"cpp_pybinding", "wait"}:
        return f"the wrapper compiles {sorted(methods - {'cpp_pybinding', 'wait'})} kernels"
    return None


def recorded_kernels(source: str) -> list[tuple[list[str], str]]:
    """The (argtypes, source) of each ``async_compile.cpp_pybinding`` call of the wrapper."""

    calls: list[tuple[list[str], str]] = []

    class Recorder:
        def __call__(self) -> Any:
            return self

        def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Any:
            calls.append((list(argtypes), source_code))
            return None

        def wait(self, scope: Any) -> None:
            pass

    namespace: dict[str, Any] = {
        "run_intermediate_hooks": None,
        "maybe_profile": None,
        "align": None,
        "AsyncCompile": Recorder(),
        "extern_kernels": None,
        "__name__": "torch_precompile_wrapper_probe",
    }
    code = compile(strip_wrapper_imports(source), "<inductor wrapper>", "exec")
    exec(code, namespace)
    return calls
