"""Inductor's Triton kernels without Triton: cubins in the file, PyTorch's static launcher.

At save (the compiling process), each ``async_compile.triton(name, source)``
of a wrapper is looked up in the wrapper's loaded module: its
``CachingAutotuner`` after autotuning holds one launcher. That launcher is
Inductor's own generated Python function (grid arithmetic, then
``runner(grid_0, grid_1, grid_2, stream, *args)``); its code object is saved
(marshal: the artifact is tied to the Python version anyway), with what the
runner needs: the cubin of the chosen configuration, the kernel's name, warps,
shared memory and argument types. A graph whose kernels were never run (so
several configurations are still candidates) is run once at save with
Inductor's own random inputs (``get_args()``), which autotunes it: the chosen
configurations travel in the file and nothing is autotuned after load.

At load, each cubin is written to the artifact's private kernel directory and
loaded with ``torch._C._StaticCudaLauncher`` (what Inductor's
``StaticallyLaunchedCudaKernel`` calls); the launcher code runs against a
runner that calls ``_launch_kernel``. Neither ``triton`` nor Inductor is
imported.
"""

from __future__ import annotations

import builtins
import marshal
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .kernels import CUBIN, KernelLoader, kernel_file, kernel_key

if TYPE_CHECKING:
    from .schema import TritonLaunch

BUILTIN_NAMES = frozenset(dir(builtins))


def triton_key(device_str: str, source: str) -> str:
    """The ``kernels`` section key of one Triton kernel (its device and source)."""
    return kernel_key(["triton", device_str], source)


# ------------------------------------------------------------------------ save


# ------------------------------------------------------------------------ load


class StaticKernel:
    """Stands in for Inductor's ``CachingAutotuner`` once autotuned: ``run(*args, stream)``."""

    def __init__(self, launcher: Callable[..., Any], profile_name: str, handles: Any) -> None:
        self._launcher = launcher
        self._profile_name = profile_name
        self._handles = handles  # the loaded module and function: kept alive with the kernel

    def run(self, *args: Any, stream: int) -> Any:
        if torch.autograd.profiler._is_profiler_enabled:
            with torch._C._profiler._RecordFunctionFast(self._profile_name):
                return self._launcher(*args, stream=stream)
        return self._launcher(*args, stream=stream)


def _runner(
    name: str, function: Any, num_warps: int, shared: int, arg_tys: str, scratch: int
) -> Any:
    launch = torch._C._StaticCudaLauncher._launch_kernel  # type: ignore[attr-defined]
    # Newer Triton passes unused scratch pointers: Inductor passes None for each.
    tys, extra = arg_tys + "O" * scratch, (None,) * scratch

    def runner(gx: int, gy: int, gz: int, stream: int, *args: Any) -> None:
        try:
            launch(function, gx, gy, gz, num_warps, shared, tys, (*args, *extra), stream)
        except RuntimeError as exc:  # the driver's message names no kernel: say which
            raise RuntimeError(
                f"launching Triton kernel {name} (grid {gx}x{gy}x{gz}, {num_warps} warps, "
                f"{shared} bytes of shared memory, argument types {tys!r}, {len(args)} "
                f"arguments) failed: {exc}"
            ) from exc

    return runner


class KernelAndTritonLoader(KernelLoader):
    """``AsyncCompile`` stand-in for wrappers with C++ and Triton kernels."""

    def __init__(
        self,
        kernels: dict[str, memoryview],
        directory: str,
        data_ptr_env: str,
        triton_specs: Mapping[str, TritonLaunch],
    ) -> None:
        super().__init__(kernels, directory, data_ptr_env)
        self._triton_specs = triton_specs
        self._devices: set[int] = set()

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> StaticKernel:
        key = triton_key(device_str, source_code)
        spec = self._triton_specs.get(key)
        if spec is None or spec.cubin not in self._kernels:
            raise KeyError(f"Triton kernel {kernel_name} is not among the artifact's kernels")
        device = spec.device
        if device not in self._devices:
            # The driver loads modules into the device's primary context: make it exist.
            torch.zeros(1, device=f"cuda:{device}")
            self._devices.add(device)
        path = kernel_file(self._directory, spec.cubin, self._kernels, suffix=CUBIN)
        loaded = torch._C._StaticCudaLauncher._load_kernel(  # type: ignore[attr-defined]
            path, spec.name, spec.shared, device
        )
        # torch 2.11 returns (function, n_regs, n_spills); later ones put the module first.
        function = loaded[0] if len(loaded) == 3 else loaded[1]
        runner = _runner(
            spec.name, function, spec.num_warps, spec.shared, spec.arg_tys, spec.scratch
        )
        code = marshal.loads(spec.launcher)
        launcher = types.FunctionType(
            code, {"runner": runner, "__builtins__": builtins}, code.co_name, spec.defaults
        )
        return StaticKernel(launcher, spec.profile_name, loaded)
