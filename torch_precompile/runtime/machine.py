"""What an artifact was built for, and whether this process can run it.

Compiled kernels are machine code and pickled objects for one torch, one Python,
one OS and architecture, and one CPU instruction set or GPU architecture.
:func:`current_system` records those at save time; :func:`check_compatible`
compares them at load time and says, naming both sides, what to do on a mismatch.

Only ``torch`` and ``torch.backends.cpu`` are imported: checking an artifact
must not pull in the compiler.
"""

from __future__ import annotations

import logging
import platform
import sys
from typing import Any

import torch
import torch.backends.cpu

from .._errors import IncompatibleSystemError

__all__ = ["check_compatible", "cpu_isa_runs_on", "current_system"]

logger = logging.getLogger("torch_precompile")

# CPU instruction sets as torch.backends.cpu.get_cpu_capability() names them.
# Baseline code runs on any CPU of its architecture. Within x86, AVX2 < AVX512.
# Everything else (VSX, Z VECTOR, SVE128/256/512, names we do not know) only
# runs on exactly the same ISA: SVE kernels are built for one vector length.
_BASELINE_ISAS = frozenset({"DEFAULT", "NO AVX"})
_X86_ISA_ORDER = ("AVX2", "AVX512")


def current_system(*, include_cuda: bool = True) -> dict[str, Any]:
    """Describe this process: torch, Python, OS, architecture, CPU ISA and CUDA device.

    ``include_cuda=False`` skips the CUDA query (which initialises CUDA) and
    records ``"cuda": None``.
    """
    return {
        "torch": str(torch.__version__),
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "platform": platform.machine(),
        "os": sys.platform,
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "cuda": _current_cuda() if include_cuda else None,
    }


def _current_cuda(index: int | None = None) -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    if index is None:
        index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {
        "device_name": torch.cuda.get_device_name(index),
        "capability": f"{major}.{minor}",
        "cuda_version": torch.version.cuda,
    }


def cpu_isa_runs_on(built_for: str, running_on: str) -> bool:
    """Whether CPU code built for ISA ``built_for`` runs on a CPU with ISA ``running_on``."""
    if built_for == running_on or built_for in _BASELINE_ISAS:
        return True
    if built_for in _X86_ISA_ORDER and running_on in _X86_ISA_ORDER:
        return _X86_ISA_ORDER.index(built_for) <= _X86_ISA_ORDER.index(running_on)
    return False


def check_compatible(
    recorded: dict[str, Any], device_type: str = "cpu", *, path: str | None = None
) -> None:
    """Raise :class:`IncompatibleSystemError` if this process cannot run an artifact
    built on the system described by ``recorded`` (a :func:`current_system` dict).

    ``device_type`` is the artifact's device, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    Keys missing from ``recorded`` are not checked (an older writer may not have
    recorded them); every mismatch found is reported in one message.
    """
    device, _, index = device_type.partition(":")
    wants_cuda = device == "cuda"
    current = current_system(include_cuda=False)
    if wants_cuda:
        current["cuda"] = _current_cuda(int(index) if index else None)
    who = f"artifact {path!r}" if path is not None else "the artifact"
    problems = []

    def differs(key: str) -> tuple[Any, Any] | None:
        if key not in recorded:
            return None
        built, here = recorded[key], current[key]
        # Bytecode and pickles are compatible across Python micro releases, not minor ones.
        same = _major_minor(built) == _major_minor(here) if key == "python" else built == here
        return None if same else (built, here)

    if pair := differs("torch"):
        built, here = pair
        problems.append(
            f"was built with torch {built}, this process runs torch {here}: "
            f"rebuild the artifact with torch {here} or install torch=={built}"
        )
    if pair := differs("python"):
        built, here = pair
        problems.append(
            f"was built with Python {built}, this process runs Python {here}: "
            f"rebuild the artifact with this Python or load it with Python {_major_minor(built)}"
        )
    if pair := differs("os"):
        built, here = pair
        problems.append(
            f"was built on OS {built!r}, this process runs on {here!r}: rebuild the artifact here"
        )
    if pair := differs("platform"):
        built, here = pair
        problems.append(
            f"was built for the {built} architecture, this machine is {here}: "
            f"rebuild the artifact on a {here} machine"
        )
    if "cpu_isa" in recorded and not cpu_isa_runs_on(
        str(recorded["cpu_isa"]), str(current["cpu_isa"])
    ):
        built, here = recorded["cpu_isa"], current["cpu_isa"]
        problems.append(
            f"was built for CPU instruction set {built}, this CPU offers only {here}: "
            f"rebuild the artifact on this machine or on one whose CPU offers at most {here}"
        )
    if wants_cuda and "cuda" in recorded:
        problems.extend(_cuda_problems(recorded["cuda"], current["cuda"]))

    if problems:
        message = f"{who} " + f"; {who} ".join(problems)
        logger.debug("incompatible artifact: %s", message)
        raise IncompatibleSystemError(message)


def _cuda_problems(built: Any, here: dict[str, Any] | None) -> list[str]:
    if not isinstance(built, dict) or "capability" not in built:
        return ["is a CUDA artifact but records no GPU it was built for: rebuild the artifact"]
    built_desc = (
        f"CUDA capability {built['capability']} ({built.get('device_name', 'unknown GPU')})"
    )
    if here is None:
        return [
            (
                f"was built for {built_desc}, this process has no CUDA device: run it on a GPU "
                f"of capability {built['capability']} or rebuild the artifact for this machine"
            )
        ]
    if str(built["capability"]) != here["capability"]:
        return [
            (
                f"was built for {built_desc}, this process runs on CUDA capability "
                f"{here['capability']} ({here['device_name']}): rebuild the artifact on this GPU "
                f"or run it on a capability {built['capability']} GPU"
            )
        ]
    return []


def _major_minor(version: Any) -> str:
    return ".".join(str(version).split(".")[:2])
