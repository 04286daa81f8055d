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
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .kernels import KernelLoader, kernel_file, kernel_key
from .local_collectives import UnknownCollectiveError, local_collectives

TRITON_SPEC_VERSION = 1
_BUILTIN_NAMES = frozenset(dir(builtins))


def triton_key(device_str: str, source: str) -> str:
    """The ``kernels`` section key of one Triton kernel (its device and source)."""
    return kernel_key(["triton", device_str], source)


# ------------------------------------------------------------------------ save


def _wrapper_module(source: str) -> Any:
    from torch._inductor.codecache import PyCodeCache

    return PyCodeCache.load(source)


def _autotuners(module: Any) -> dict[str, Any]:
    return {
        name: obj
        for name, obj in vars(module).items()
        if hasattr(obj, "launchers") and callable(getattr(obj, "run", None))
    }


def _warm(module: Any) -> None:
    """Run the graph once on Inductor's random inputs, so that each kernel autotunes;
    its collectives answered on this rank alone (only the saving rank runs it)."""
    get_args = getattr(module, "get_args", None)
    if get_args is None:
        raise ValueError("the wrapper has no get_args() to autotune its kernels with")
    with torch.no_grad(), local_collectives():
        module.call(get_args())
    torch.cuda.synchronize()


def _cubin(kernel: Any, device: int) -> bytes:
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

    raw = getattr(kernel, "cubin_raw", None)
    if raw:
        return bytes(raw)
    path = os.path.join(
        triton_cache_dir(device), triton_hash_to_path_key(kernel.hash), f"{kernel.name}.cubin"
    )
    with open(path, "rb") as f:
        return f.read()


def triton_sections(
    wrappers: Sequence[tuple[str, Sequence[tuple[str, str, str]]]],
) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]] | str:
    """Launch specs and cubins of the Triton kernels of each wrapper: ``(wrapper
    source, its calls (name, kernel source, device))``; or why they cannot be
    launched statically."""
    specs: dict[str, dict[str, Any]] = {}
    binaries: dict[str, bytes] = {}
    for wrapper_source, calls in wrappers:
        if not calls:
            continue
        module = _wrapper_module(wrapper_source)
        tuners = _autotuners(module)
        if any(len(t.launchers) != 1 for t in tuners.values()):
            try:
                _warm(module)
            except UnknownCollectiveError as exc:
                return f"Triton kernels to autotune in a graph with a collective: {exc}"
        reason = _add_specs(calls, tuners, specs, binaries)
        if reason is not None:
            return reason
    return specs, binaries


def _add_specs(
    calls: Sequence[tuple[str, str, str]],
    tuners: dict[str, Any],
    specs: dict[str, dict[str, Any]],
    binaries: dict[str, bytes],
) -> str | None:
    for name, source, device_str in calls:
        key = triton_key(device_str, source)
        if key in specs:
            continue
        tuner = tuners.get(name)
        if tuner is None or len(tuner.launchers) != 1:
            return f"Triton kernel {name} was not autotuned to one configuration"
        if tuner.inductor_meta.get("coordinate_descent_tuning") or tuner.inductor_meta.get(
            "store_cubin"
        ):
            return f"Triton kernel {name}: coordinate descent tuning or store_cubin"
        launcher = tuner.launchers[0]
        if not getattr(launcher, "_is_static", False):
            return (
                f"Triton kernel {name} is not launched by the static CUDA launcher "
                f"({_why_not_static(tuner)})"
            )
        runner = launcher.__globals__.get("runner")
        kernel = getattr(runner, "__self__", None)
        code = launcher.__code__
        names = set(code.co_names) - {"runner"}
        if kernel is None or names - _BUILTIN_NAMES or code.co_freevars:
            return f"Triton kernel {name}: its launcher reads {sorted(names - _BUILTIN_NAMES)}"
        device = int(getattr(tuner.triton_meta.get("device"), "index", 0) or 0)
        try:
            binaries[key] = _cubin(kernel, device)
        except OSError as exc:
            return f"Triton kernel {name}: its cubin is not found ({exc})"
        specs[key] = {
            "name": kernel.name,
            "launcher": marshal.dumps(code),
            "defaults": launcher.__defaults__,
            "num_warps": int(kernel.num_warps),
            "shared": int(kernel.shared),
            "arg_tys": str(kernel.arg_tys),
            "scratch": int(bool(kernel.has_global_scratch))
            + int(bool(getattr(kernel, "has_profile_scratch", False))),
            "device": device,
            "profile_name": tuner.inductor_meta.get("kernel_name", name),
        }
    return None


def _why_not_static(tuner: Any) -> str:
    """What Inductor's static launcher says of the tuner's kernel (a diagnostic)."""
    try:
        from torch._inductor import config
        from torch._inductor.runtime.triton_heuristics import StaticTritonCompileResult

        for result in getattr(tuner, "compile_results", ()):
            kernel = getattr(result, "kernel", None)
            if kernel is None:
                continue
            with config.patch(strict_static_triton_launcher=True):
                StaticTritonCompileResult.can_statically_launch(
                    kernel, tuner.inductor_meta, tuner.triton_meta, tuner.heuristic_type
                )
        return "no reason given"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:400]


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


def _runner(function: Any, num_warps: int, shared: int, arg_tys: str, scratch: int) -> Any:
    launch = torch._C._StaticCudaLauncher._launch_kernel  # type: ignore[attr-defined]
    if scratch:
        # Newer Triton passes unused scratch pointers: Inductor passes None for each.
        tys, extra = arg_tys + "O" * scratch, (None,) * scratch

        def runner(gx: int, gy: int, gz: int, stream: int, *args: Any) -> None:
            launch(function, gx, gy, gz, num_warps, shared, tys, (*args, *extra), stream)

        return runner

    def plain_runner(gx: int, gy: int, gz: int, stream: int, *args: Any) -> None:
        launch(function, gx, gy, gz, num_warps, shared, arg_tys, args, stream)

    return plain_runner


class KernelAndTritonLoader(KernelLoader):
    """``AsyncCompile`` stand-in for wrappers with C++ and Triton kernels."""

    def __init__(
        self,
        kernels: dict[str, memoryview],
        directory: str,
        data_ptr_env: str,
        triton_specs: dict[str, dict[str, Any]],
    ) -> None:
        super().__init__(kernels, directory, data_ptr_env)
        self._triton_specs = triton_specs
        self._devices: set[int] = set()

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> StaticKernel:
        key = triton_key(device_str, source_code)
        spec = self._triton_specs.get(key)
        if spec is None or key not in self._kernels:
            raise KeyError(f"Triton kernel {kernel_name} is not among the artifact's kernels")
        if spec.get("version", TRITON_SPEC_VERSION) != TRITON_SPEC_VERSION:
            raise ValueError("the Triton kernel spec was written by another version")
        device = int(spec["device"])
        if device not in self._devices:
            # The driver loads modules into the device's primary context: make it exist.
            torch.zeros(1, device=f"cuda:{device}")
            self._devices.add(device)
        path = kernel_file(self._directory, key, self._kernels, suffix=".cubin")
        loaded = torch._C._StaticCudaLauncher._load_kernel(  # type: ignore[attr-defined]
            path, spec["name"], spec["shared"], device
        )
        # torch 2.11 returns (function, n_regs, n_spills); later ones put the module first.
        function = loaded[0] if len(loaded) == 3 else loaded[1]
        runner = _runner(
            function, spec["num_warps"], spec["shared"], spec["arg_tys"], spec["scratch"]
        )
        code = marshal.loads(spec["launcher"])
        launcher = types.FunctionType(
            code, {"runner": runner, "__builtins__": builtins}, code.co_name, spec["defaults"]
        )
        return StaticKernel(launcher, spec["profile_name"], loaded)
