"""The check of :mod:`contract`: each entry resolved on the installed torch, and every
one missing or changed reported at once."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any

from .contract import CONTRACT, PrivateName
from .contract_probes import PROBES


def resolve(name: str) -> Any:
    """The object ``"module:attr.path"`` names (ImportError/AttributeError if none)."""
    module, _, path = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _assigned(cls: type) -> set[str]:
    """The ``self.<name> =`` assignments in a Python class's source (``__post_init__``...)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"\bself\.(\w+)\s*(?::[^=]+)?=", source))


def _has(obj: Any, use: str) -> bool | None:
    """Whether ``obj`` offers ``use``: a config key, a parameter, a field or a member
    (None: it cannot be told, a C++ callable's keyword parameters); ``"a|b"``: either."""
    if "|" in use:
        answers = [_has(obj, one) for one in use.split("|")]
        return True if any(answers) else None if None in answers else False
    config = getattr(obj, "_config", None)
    if isinstance(config, dict):  # a torch config module
        return use in config
    if hasattr(obj, use):
        return True
    if isinstance(obj, type):
        if dataclasses.is_dataclass(obj) and use in {f.name for f in dataclasses.fields(obj)}:
            return True
        if any(use in getattr(k, "__annotations__", {}) for k in obj.__mro__):
            return True
        if use in _assigned(obj):
            return True
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None if callable(obj) else False
    # A function's **kwargs takes any keyword; a class's does not make a member.
    if not isinstance(obj, type) and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True
    return use in params


def _older(version: str) -> bool:
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) < version


def _is_cuda_build() -> bool:
    import torch

    return torch.version.cuda is not None


def problems(contract: tuple[PrivateName, ...] = CONTRACT) -> list[str]:
    """Each entry of ``contract`` that the installed torch lacks or changed, as one line."""
    found = []
    cuda = None
    for entry in contract:
        if entry.cuda:
            cuda = _is_cuda_build() if cuda is None else cuda
            if not cuda:
                continue
        if (entry.since and _older(entry.since)) or (entry.until and not _older(entry.until)):
            continue
        failures = []
        for place in entry.places():
            try:
                if entry.after:
                    importlib.import_module(entry.after)
                obj = resolve(place)
            except Exception as exc:
                failures.append(f"missing: {place} ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            # Uses that cannot be read off a C++ callable are checked by its probe.
            lacking = [
                use
                for use in entry.uses
                if not _has(obj, use) and not (entry.probe and _has(obj, use) is None)
            ]
            why = [f"has no {', '.join(lacking)}"] if lacking else []
            if entry.probe and not lacking:
                try:
                    PROBES[entry.probe](obj)
                except Exception as exc:
                    why.append(f"fails our call {entry.probe} ({type(exc).__name__}: {exc})")
            if not why:
                break
            failures.append(f"changed: {place} {'; '.join(why)}")
        else:
            found.append(" / ".join(failures))
    return found


def report(found: list[str]) -> str:
    """One readable message for :func:`problems`' lines."""
    import torch

    head = (
        f"{len(found)} private PyTorch name(s) that torch_precompile uses are missing or "
        f"changed in torch {torch.__version__} (fix them in torch_precompile/_compat/):"
    )
    return "\n".join([head, *(f"  - {line}" for line in found)])
