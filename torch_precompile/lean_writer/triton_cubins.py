"""Inductor's Triton kernels for the lean runtime: the autotuned launch parameters
and the cubins, read from one run of the wrapper module. The cubins are read as
Inductor's compile returns (:func:`kept_cubins`), while Triton's cache surely holds
them; a save takes them from the artifact."""

from __future__ import annotations

import logging
import marshal
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._compat.local_collectives import UnknownCollectiveError, local_collectives
from ..lean.kernels import kernel_key
from ..lean.schema import TritonLaunch
from ..lean.triton_kernels import BUILTIN_NAMES, triton_key

log = logging.getLogger(__name__)


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


def _untuned(tuner: Any) -> bool:
    """Whether a kernel's configuration is still to be chosen: several candidates, or
    coordinate descent tuning (its first run tunes it; the winner is then the launcher)."""
    if len(tuner.launchers) != 1:
        return True
    coordesc = tuner.inductor_meta.get("coordinate_descent_tuning")
    return bool(coordesc) and not getattr(tuner.launchers[0].config, "found_by_coordesc", False)


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
    owned: Mapping[str, bytes | memoryview] | None = None,
) -> tuple[dict[str, TritonLaunch], dict[str, bytes]] | str:
    """Launch specs and cubins of the Triton kernels of each wrapper: ``(wrapper
    source, its calls (name, kernel source, device))``; or why they cannot be
    launched statically. A cubin in ``owned`` (the artifact's, by key) is taken from
    there; any other is read from the kernel or from Triton's cache."""
    specs: dict[str, TritonLaunch] = {}
    binaries: dict[str, bytes] = {}
    for wrapper_source, calls in wrappers:
        if not calls:
            continue
        module = _wrapper_module(wrapper_source)
        tuners = _autotuners(module)
        if any(_untuned(t) for t in tuners.values()):
            try:
                _warm(module)
            except UnknownCollectiveError as exc:
                return f"Triton kernels to autotune in a graph with a collective: {exc}"
        reason = _add_specs(calls, tuners, specs, binaries, owned or {})
        if reason is not None:
            return reason
    return specs, binaries


def kept_cubins(wrappers: Sequence[tuple[str, Sequence[tuple[str, str, str]]]]) -> dict[str, bytes]:
    """The cubin of each Triton kernel of the wrappers (as :func:`triton_sections`
    takes them), by key, read as Inductor's compile returns: the artifact owns them
    from then on. Kernels still to tune are tuned now, by one run of their graph on
    Inductor's random inputs (a save did so before). None are kept where the kernels
    cannot be launched statically (the load then compiles them)."""
    found = triton_sections(wrappers)
    if isinstance(found, str):
        log.debug("no Triton cubins kept: %s", found)
        return {}
    return found[1]


def _add_specs(
    calls: Sequence[tuple[str, str, str]],
    tuners: dict[str, Any],
    specs: dict[str, TritonLaunch],
    binaries: dict[str, bytes],
    owned: Mapping[str, bytes | memoryview],
) -> str | None:
    for name, source, device_str in calls:
        key = triton_key(device_str, source)
        if key in specs:
            continue
        tuner = tuners.get(name)
        if tuner is None or len(tuner.launchers) != 1:
            return f"Triton kernel {name} was not autotuned to one configuration"
        if tuner.inductor_meta.get("store_cubin"):
            return f"Triton kernel {name}: store_cubin"
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
        if kernel is None or names - BUILTIN_NAMES or code.co_freevars:
            return f"Triton kernel {name}: its launcher reads {sorted(names - BUILTIN_NAMES)}"
        device = int(getattr(tuner.triton_meta.get("device"), "index", 0) or 0)
        # One source tuned in two graphs (two variants' sizes) can win with two
        # configurations, so two binaries: each is named by its compile's hash too,
        # and a spec names its own (a spec's warps launching another's cubin fail).
        cubin = kernel_key(["triton", device_str, str(kernel.hash)], source)
        try:
            binaries[cubin] = bytes(owned[cubin]) if cubin in owned else _cubin(kernel, device)
        except OSError as exc:
            return f"Triton kernel {name}: its cubin is not found ({exc})"
        specs[key] = TritonLaunch(
            cubin=cubin,
            name=kernel.name,
            launcher=marshal.dumps(code),
            defaults=launcher.__defaults__,
            num_warps=int(kernel.num_warps),
            shared=int(kernel.shared),
            arg_tys=str(kernel.arg_tys),
            scratch=int(bool(kernel.has_global_scratch))
            + int(bool(getattr(kernel, "has_profile_scratch", False))),
            device=device,
            profile_name=tuner.inductor_meta.get("kernel_name", name),
        )
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
