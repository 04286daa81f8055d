"""``PrecompiledArtifact``: the public face of a compiled model, and its text views."""

from __future__ import annotations

import dataclasses
import logging
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .. import _compat
from ..file import sections as names
from ..guards import Guards, RangeGuard, describe_source
from ..lean.guard_schema import GuardTree
from ..lean.standin.module import module_tensors
from .call import Runtime
from .pythonify import write_module
from .signature import CallSignature

log = logging.getLogger("torch_precompile")


def canonical_strides(value: Any) -> Any:
    """A contiguous tensor with other strides on its size-1 dimensions (``x[i : i + 1]``
    of a larger batch) as the same memory with contiguous strides; anything else as
    it is. Eager computes the same on both, and the guards, recorded on a contiguous
    example, compare the strides of every dimension."""
    if type(value) is not torch.Tensor or value.dim() < 2 or not value.is_contiguous():
        return value
    strides, step = [], 1
    for size in reversed(value.shape):
        strides.append(step)
        step *= max(int(size), 1)
    strides.reverse()
    if tuple(strides) == value.stride():
        return value
    return value.as_strided(value.shape, strides)


def variant_label(artifact: PrecompiledArtifact) -> str:
    """``inference, static`` / ``training, dynamic``: what kind of variant this is."""
    dynamic = bool(artifact.guards.of_kind(RangeGuard))
    kind = "training" if artifact.training else "inference"
    return f"{kind}, {'dynamic' if dynamic else 'static'}"


@dataclasses.dataclass(frozen=True)
class PrecompiledArtifact:
    """A compiled model: callable with the model's arguments, savable to one file."""

    guards: Guards
    signature: CallSignature
    system: dict[str, Any]
    training: bool
    device_type: str
    timings: dict[str, float]
    bytecode: types.CodeType = dataclasses.field(repr=False)
    compiled_function: Any = dataclasses.field(repr=False)
    _runtime: Runtime = dataclasses.field(repr=False, compare=False)
    _sizes: dict[str, int] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    variants: tuple[PrecompiledArtifact, ...] = dataclasses.field(
        default=(), repr=False, compare=False
    )
    globals_module: str = dataclasses.field(default="", repr=False)
    # The stubbed run of the bytecode at precompile (what the forward writes); in process only.
    _recording: Any = dataclasses.field(default=None, repr=False, compare=False)
    # Where the artifact was saved to or loaded from ({"path": ...}); set by save and load.
    _origin: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # The compiled kernels' binaries by key (C++ shared objects): taken as Inductor
    # returned them, or the file's; what save ships, so it never reads Inductor's cache.
    kernels: Mapping[str, bytes | memoryview] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # Dynamo's guard tree read at precompile as the lean check's spec (None: it cannot
    # run it, or loaded); save writes it into the lean section.
    lean_guards: GuardTree | None = dataclasses.field(default=None, repr=False, compare=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(canonical_strides(a) for a in args)
        kwargs = {k: canonical_strides(v) for k, v in kwargs.items()}
        return self._runtime(args, kwargs)

    @property
    def runtime(self) -> Runtime:
        """The call path this artifact runs (binding, guards, the compiled call, outputs)."""
        return self._runtime

    @property
    def origin(self) -> Mapping[str, Any]:
        """Where the artifact was saved to or loaded from (``path``, ``created``); empty
        before."""
        return types.MappingProxyType(self._origin)

    @property
    def recording(self) -> Any:
        """The stubbed run of the bytecode at precompile (what the forward writes), or
        None (loaded artifacts)."""
        return self._recording

    def saved_as(self, path: str, created: str, sizes: Mapping[str, int]) -> None:
        """Note the file this artifact was just written to, and its sizes there."""
        self._sizes.clear()
        self._sizes.update(sizes)
        self._origin.update(path=path, created=created)

    @property
    def module(self) -> Any:
        """What the compiled code reads as ``self``: the bound model or its stand-in."""
        return self._runtime.bound_self

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The weights the artifact computes with (for building an optimizer)."""
        mod = self._runtime.bound_self
        return mod.named_parameters() if isinstance(mod, torch.nn.Module) else iter(())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        mod = self._runtime.bound_self
        return mod.named_buffers() if isinstance(mod, torch.nn.Module) else iter(())

    def buffers(self) -> Iterator[torch.Tensor]:
        return (b for _, b in self.named_buffers())

    @property
    def sizes(self) -> dict[str, int]:
        """Bytes of the compiled code (kernels, guards, bytecode) and of the weights.

        Read from the file once saved or loaded; before that, measured in
        process (the compiled function serialized once, the weights' bytes).
        """
        if not self._sizes:
            self._sizes.update(_measure_sizes(self))
        return dict(self._sizes)

    def to_python(
        self,
        path: str | os.PathLike[str],
        *,
        artifact_path: str | os.PathLike[str] | None = None,
    ) -> str:
        """Write a readable Python module that runs this artifact; returns its source.

        The module checks the guards as plain ``if`` statements, shows which
        parameter, buffer or input goes where in the compiled call, calls the
        compiled code and rebuilds the output. Its ``forward(...)`` loads
        kernels and weights from ``artifact_path`` (default: the file this
        artifact was saved to or loaded from).
        """
        return write_module(self, path, artifact_path)

    def as_text(self) -> str:
        """Guards by stage, signature, system, sizes and stage timings, for reading."""
        lines = [
            f"PrecompiledArtifact ({'training' if self.training else 'inference'}, "
            f"{self.device_type})"
        ]
        if self._origin.get("path"):
            lines.append(f"file: {self._origin['path']}")
        lines.append("signature:")
        lines.extend(f"  {line}" for line in signature_lines(self.signature))
        lines.append(
            "system: " + ", ".join(f"{k}={v}" for k, v in self.system.items() if v is not None)
        )
        sizes = self.sizes
        if sizes:
            lines.append("sizes: " + ", ".join(f"{k}={_human(v)}" for k, v in sizes.items()))
        if self.timings:
            lines.append(
                "stage timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items())
            )
        if self.variants:
            for i, variant in enumerate(self.variants):
                lines.append(f"variant {i} ({variant_label(variant)}) guards:")
                lines.extend(f"  {line}" for line in str(variant.guards).splitlines())
            return "\n".join(lines)
        lines.append("guards:")
        lines.extend(f"  {line}" for line in str(self.guards).splitlines())
        return "\n".join(lines)

    def __repr__(self) -> str:
        if self.variants:
            kinds = "; ".join(variant_label(v) for v in self.variants)
            return f"PrecompiledArtifact({len(self.variants)} variants: {kinds})"
        return (
            f"PrecompiledArtifact({'training' if self.training else 'inference'}, "
            f"{self.device_type}, {len(self.guards)} guards)"
        )


def _measure_sizes(artifact: PrecompiledArtifact) -> dict[str, int]:
    sizes: dict[str, int] = {}
    try:
        sizes[names.COMPILED] = len(_compat.serialize_compiled_function(artifact.compiled_function))
    except Exception as exc:  # a view must not fail because a size cannot be measured
        log.debug("could not measure the compiled function's size: %s", exc)
    mod = artifact.module
    if isinstance(mod, torch.nn.Module):
        sizes[names.WEIGHTS] = sum(
            t.numel() * t.element_size() for t in module_tensors(mod).values()
        )
    return sizes


def human_size(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    return _human(n)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def signature_lines(sig: CallSignature) -> list[str]:
    """The recorded signature, a line each: the forward, its example arguments, the graph."""
    lines = []
    if sig.text is not None:
        lines.append(f"forward{sig.text}")
    for name, desc in (sig.parameters or {}).items():
        lines.append(f"{name}: {_short(desc)}")
    sources = sig.graph_inputs
    if sources:
        kinds = [describe_source(src).split(" ", 1)[0] for src in sources]
        counts = ", ".join(
            f"{kinds.count(k)} {k}{'s' if kinds.count(k) > 1 else ''}" for k in dict.fromkeys(kinds)
        )
        lines.append(f"graph inputs: {len(sources)} ({counts})")
    outs = sig.outputs
    if outs:
        lines.append(
            "graph outputs: "
            + ", ".join(
                _short({"tensor": o}) if "dtype" in o else o.get("value", "?") for o in outs
            )
        )
    return lines


def _short(desc: Any) -> str:
    if isinstance(desc, dict) and "tensor" in desc:
        t = desc["tensor"]
        return f"{t['dtype']}[{', '.join(str(s) for s in t['shape'])}]"
    if isinstance(desc, dict) and "value" in desc:
        return f"{desc.get('type', '')} = {desc['value']!r}"
    if isinstance(desc, dict):
        for key in ("tuple", "list"):
            if key in desc:
                return f"{key}(" + ", ".join(_short(d) for d in desc[key]) + ")"
        if "dict" in desc:
            return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in desc["dict"].items()) + "}"
    return str(desc)
