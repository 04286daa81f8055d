"""Inductor's generated Python wrapper (``call(args)``): its imports, the kernels
it asks for, and running it with light stand-ins instead of Inductor."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import linear_rows  # noqa: F401  (the operator a CPU file's wrapper may call)
from .kernels import KernelLoader, kernel_dir
from .pycode import code_for
from .triton_kernels import KernelAndTritonLoader

if TYPE_CHECKING:
    from .schema import TritonLaunch

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


def _graph_marker() -> None:
    pass  # ``start_graph``/``end_graph``: save refuses wrappers that call them


def _assert_tensor_metadata(
    tensor: torch.Tensor | None,
    expected_size: Sequence[Any],
    expected_stride: Sequence[Any],
    expected_dtype: torch.dtype,
    op_name: str | None = None,
) -> None:
    """Inductor's ``runtime_utils.assert_tensor_metadata`` (torch 2.14+), whose module
    imports sympy and Dynamo: the same dtype check, then the same C++ size/stride check."""
    if tensor is None:
        return
    if tensor.dtype != expected_dtype:
        where = f"\nError in op: {op_name}" if op_name else ""
        raise RuntimeError(
            f"expected dtype {expected_dtype} but got {tensor.dtype}{where}\nThis error most "
            "often comes from an incorrect fake (aka meta) kernel for a custom op."
        )
    torch._C._dynamo.guards.assert_size_stride(tensor, expected_size, expected_stride, op_name)


# Import lines of Inductor's wrapper, and the name each binds (save checks that
# the wrapper imports nothing else from torch._inductor).
WRAPPER_IMPORTS: dict[str, str] = {
    "from torch._inductor.hooks import run_intermediate_hooks": "run_intermediate_hooks",
    "from torch._inductor.utils import maybe_profile": "maybe_profile",
    "from torch._inductor.codegen.memory_planning import _align as align": "align",
    "from torch._inductor.async_compile import AsyncCompile": "AsyncCompile",
    "from torch._inductor.select_algorithm import extern_kernels": "extern_kernels",
    # CUDA wrappers: ``triton`` is only named inside the kernels' source strings,
    # and the graph markers only run under Inductor's benchmark/profile flags.
    "import triton": "triton",
    "import triton.language as tl": "tl",
    "from torch._inductor.runtime.triton_heuristics import start_graph, end_graph": "start_graph",
    # torch 2.14+: a dtype check beside each extern kernel's size/stride assertion.
    "from torch._inductor.runtime.runtime_utils import assert_tensor_metadata": (
        "assert_tensor_metadata"
    ),
}


def _outside_strings(source: str) -> list[tuple[str, bool]]:
    """Each line of the wrapper and whether it is code (not inside a kernel's
    ``'''`` source string, where Triton kernels carry their own imports)."""
    out = []
    inside = False
    for line in source.splitlines():
        out.append((line, not inside))
        if line.count("'''") % 2:
            inside = not inside
    return out


def strip_wrapper_imports(source: str) -> str:
    """The wrapper without its ``torch._inductor`` and ``triton`` imports (the names
    are injected); kernel source strings are left as they are."""
    return "\n".join(
        "" if code and line.strip() in WRAPPER_IMPORTS else line
        for line, code in _outside_strings(source)
    )


def main_code(source: str) -> str:
    """The wrapper's own code: no kernel source strings, no ``__main__`` harness."""
    main = source.split('\nif __name__ == "__main__":', 1)[0]
    return "\n".join(line if code else "" for line, code in _outside_strings(main))


def wrapper_inductor_imports(source: str) -> list[str]:
    """Top-level lines importing from ``torch._inductor`` (or ``triton``) that we
    cannot stand in for."""
    bad = []
    for line in main_code(source).splitlines():
        if line.startswith((" ", "\t")):
            continue  # function-local imports (benchmark helpers) never run
        stripped = line.strip()
        if stripped in WRAPPER_IMPORTS:
            continue
        if "torch._inductor" in stripped or stripped.startswith(("import triton", "from triton")):
            bad.append(stripped)
    return bad


def clone_preserve_strides(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its sizes and strides (expanded dimensions included)."""
    if 0 in x.size():
        needed = 0
    else:
        needed = sum((size - 1) * stride for size, stride in zip(x.size(), x.stride())) + 1
    buffer = torch.as_strided(x, (needed,), (1,)).clone()
    return torch.as_strided(buffer, x.size(), x.stride())


def _namespace(loader: Any, extern_names: Sequence[str]) -> dict[str, Any]:
    return {
        "run_intermediate_hooks": _run_intermediate_hooks,
        "maybe_profile": _maybe_profile,
        "align": _align,
        "AsyncCompile": loader,
        "extern_kernels": _ExternKernels(extern_names),
        "start_graph": _graph_marker,
        "end_graph": _graph_marker,
        "assert_tensor_metadata": _assert_tensor_metadata,
    }


class GraphCall:
    """The compiled graph's boxed call (Inductor's ``call(args)``), with the input
    alignment Inductor's runtime adds around it."""

    def __init__(
        self,
        call: Callable[[list[Any]], Any],
        inputs_to_check: Sequence[int],
        mutated_inputs: Sequence[int] = (),
    ) -> None:
        self._call = call
        self._inputs_to_check = tuple(inputs_to_check)
        self._mutated = frozenset(mutated_inputs)
        # With Inductor's graph partitions: replaces each partition function
        # (``fns[i](partition_i)``), as Inductor does to record CUDA graphs.
        self.apply_to_partitions: Callable[[list[Any]], None] | None = None

    def call_list(self, inputs: list[Any], received: list[Any] | None = None) -> Any:
        """Inductor's boxed convention: ``call`` takes (and empties) the list.

        An input Inductor assumed aligned that is not runs as an aligned copy;
        if the graph writes that input, the copy is written back after the call
        (as Inductor's ``align_inputs_from_check_idxs``). ``received`` gets the
        inputs as the graph received them (an output aliasing an input is
        placed relative to those)."""
        written_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in self._inputs_to_check:
            t = inputs[i]
            if t.data_ptr() % ALIGNMENT:
                inputs[i] = clone_preserve_strides(t)
                if i in self._mutated:
                    written_back.append((t, inputs[i]))
        if received is not None:
            received.extend(inputs)
        out = self._call(inputs)
        for original, copy in written_back:
            original.copy_(copy)
        return out


def build_graph_call(
    wrapper_source: str,
    extern_names: Sequence[str],
    inputs_to_check: Sequence[int],
    kernels: Mapping[str, bytes | memoryview],
    data_ptr_env: str,
    filename: str,
    triton_specs: Mapping[str, TritonLaunch] | None = None,
    mutated_inputs: Sequence[int] = (),
    constants: Mapping[str, Any] | None = None,
    code: Any = None,
) -> GraphCall:
    """Execute Inductor's wrapper with the shipped kernels (``{key: bytes}``: C++ shared
    objects, Triton cubins described by ``triton_specs``); returns its ``call``.
    ``constants``: the module attributes Inductor's loader would set (a DeviceMesh);
    ``code``: the wrapper compiled at save (:mod:`.pycode`), used where it fits."""
    directory = kernel_dir(kernels)
    loader: KernelLoader
    if triton_specs:
        loader = KernelAndTritonLoader(kernels, directory, data_ptr_env, triton_specs)
    else:
        loader = KernelLoader(kernels, directory, data_ptr_env)
    module = types.ModuleType("torch_precompile_wrapper")
    module.__file__ = filename
    namespace = module.__dict__
    namespace.update(_namespace(loader, extern_names))
    compiled = code_for(strip_wrapper_imports(wrapper_source), filename, code)
    exec(compiled, namespace)  # generated code shipped in the (trusted) artifact
    namespace.update(constants or {})  # the wrapper declares them as None
    graph_call = GraphCall(namespace["call"], inputs_to_check, mutated_inputs)
    graph_call.apply_to_partitions = namespace.get("recursively_apply_fns")
    return graph_call
