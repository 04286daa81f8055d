"""Stage 4: bundle the compiled code, guards and weights into a callable artifact."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import _compat
from ._errors import GuardError
from ._guards import (
    ROOT_SOURCE,
    Guard,
    Guards,
    IdentityChecks,
    describe_source,
    diagnose,
    explain_hooks,
    hooked_modules,
    identity_guard,
    range_guards,
)
from ._index_bounds import IndexChecks
from ._inductor_stage import InductorOutput
from ._signature import make_binder

log = logging.getLogger("torch_precompile")


class Runtime:
    """Calls PyTorch's compiled function with guard checks and readable failures.

    ``bound_self`` is what the traced code sees as ``self``: the live model,
    or a stand-in rebuilt from the file's weights.
    """

    def __init__(
        self,
        compiled_function: Any,
        guards: Guards,
        bound_self: Any,
        training: bool,
        grad_enabled: bool | None = None,
    ) -> None:
        guard_manager, fn, signature = _compat.compiled_function_parts(compiled_function)
        self.compiled_function = compiled_function
        self.guard_manager = guard_manager
        self.fn = fn
        self.signature: inspect.Signature = signature
        self._bind = make_binder(signature)
        self.closure_locals = _compat.compiled_function_closure_locals(compiled_function)
        self.guards = guards
        self.bound_self = bound_self
        self.training = training
        self.identity = IdentityChecks(guards, getattr(fn, "__globals__", {}))
        # The grad mode Dynamo captured (and guards); an inference artifact
        # whose inputs need no grad runs under it whatever the ambient mode.
        self.grad_enabled = training if grad_enabled is None else grad_enabled
        self._cudagraphs = _compat.compiled_function_uses_cudagraphs(compiled_function)
        self._params: list[torch.Tensor] = (
            list(bound_self.parameters()) if isinstance(bound_self, torch.nn.Module) else []
        )
        # Module hooks the compiled code would not run: the model's own and global
        # ones, checked here; the submodules' are in Dynamo's guard tree. An artifact
        # saved before the ``hooks`` entry existed checks its bound model.
        sources = hooked_modules(guards)
        if sources is None:
            is_module = isinstance(bound_self, torch.nn.Module)
            sources = [ROOT_SOURCE] if is_module else []
        root = bound_self if ROOT_SOURCE in sources else None
        self._hook_sources = sources
        self._hooks_present = _compat.hook_check(root, bool(sources))
        # Out-of-range indices would abort the process inside Inductor's kernels.
        self._index_checks = IndexChecks(guards)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.training and torch.is_grad_enabled() != self.grad_enabled:
            culprit = self._requires_grad(args, kwargs) if torch.is_grad_enabled() else None
            if culprit is not None:
                raise GuardError(
                    f"grad mode: this is an inference artifact (captured under torch.no_grad()), "
                    f"called with grad enabled while {culprit} requires grad; call it under "
                    "torch.no_grad(), or capture again with grad enabled for a training artifact "
                    "[aot_autograd]"
                )
            # Nothing requires grad, so either grad mode gives eager's result.
            with torch.set_grad_enabled(self.grad_enabled):
                return self._checked_call(args, kwargs)
        return self._checked_call(args, kwargs)

    def _requires_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                return "an input"
        for p in self._params:
            if p.requires_grad:
                return "a parameter of the model"
        return None

    def light_guards_hold(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Issue 16: whether the lean load's plain-Python guards pass (False if none)."""
        light = getattr(self.guard_manager, "light", None)
        if light is None:
            return False
        full = (self.bound_self, *args) if self.bound_self is not None else args
        try:
            arguments = self._bind(*full, **kwargs)
        except TypeError:
            return False
        f_locals = {**self.closure_locals, **arguments} if self.closure_locals else arguments
        return bool(light.check(f_locals))

    def _checked_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        full = (self.bound_self, *args) if self.bound_self is not None else args
        failure = self._guard_failure(full, kwargs)
        if failure is not None:
            raise failure
        if self._cudagraphs:
            _compat.begin_cudagraph_step()
        return self.fn(*full, **kwargs)

    def _guard_failure(self, full: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardError | None:
        try:
            arguments = self._bind(*full, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"arguments do not match the captured signature {self.signature}: {exc}"
            ) from None
        f_locals = {**self.closure_locals, **arguments} if self.closure_locals else arguments
        failure = self.hooks_failure(f_locals)
        if failure is not None:
            return failure
        if not self.guard_manager.check(f_locals):
            reason = _compat.guard_failure_reason(self.guard_manager, f_locals)
            return diagnose(self.guards, f_locals, reason)
        failure = self.identity.check(f_locals)
        if failure is None:
            self.check_indices(f_locals)
        return failure

    def hooks_failure(self, f_locals: dict[str, Any]) -> GuardError | None:
        """The model's own or a global module hook the compiled code would not run."""
        if self._hooks_present is None or not self._hooks_present():
            return None
        return explain_hooks(self._hook_sources, f_locals) or GuardError(
            "a module hook is registered on the model or globally, and the compiled code "
            "runs no module hooks; remove it (handle.remove()) before calling the artifact "
            "[dynamo]"
        )

    def check_indices(self, f_locals: dict[str, Any]) -> None:
        """Raise IndexError, as eager does, for an index input out of its range."""
        if self._index_checks.checks:
            self._index_checks.check(f_locals)

    def first_failure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardError | None:
        """The first guard this call breaks (None: the call may run), without running it."""
        if not self.training and torch.is_grad_enabled() != self.grad_enabled:
            culprit = self._requires_grad(args, kwargs) if torch.is_grad_enabled() else None
            if culprit is not None:
                return GuardError(
                    f"grad mode: an inference artifact, called with grad enabled while {culprit} "
                    "requires grad [aot_autograd]"
                )
            with torch.set_grad_enabled(self.grad_enabled):
                return self._check_only(args, kwargs)
        return self._check_only(args, kwargs)

    def _check_only(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardError | None:
        full = (self.bound_self, *args) if self.bound_self is not None else args
        return self._guard_failure(full, kwargs)


class VariantRuntime:
    """Runs the first of several compiled variants whose guards hold for the call."""

    def __init__(self, variants: Sequence[PrecompiledArtifact]) -> None:
        self.variants = tuple(variants)
        first = self.variants[0]._runtime
        self.bound_self = first.bound_self
        self.training = first.training
        self.grad_enabled = first.grad_enabled

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Issue 16: after a lean load, a variant whose plain-Python guards hold runs
        # before any variant builds Dynamo's guard manager (which imports Dynamo).
        for variant in self.variants:
            runtime = variant._runtime
            if runtime.light_guards_hold(args, kwargs):
                if runtime.first_failure(args, kwargs) is None:
                    return runtime(args, kwargs)
                break
        failures = []
        for i, variant in enumerate(self.variants):
            runtime = variant._runtime
            failure = runtime.first_failure(args, kwargs)
            if failure is None:
                return runtime(args, kwargs)
            failures.append(f"variant {i} ({variant_label(variant)}): {failure}")
        raise GuardError("no variant's guards hold for this call:\n  " + "\n  ".join(failures))


def variant_label(artifact: PrecompiledArtifact) -> str:
    """``inference, static`` / ``training, dynamic``: what kind of variant this is."""
    dynamic = any(g.kind == "shape" and isinstance(g.expected, dict) for g in artifact.guards)
    kind = "training" if artifact.training else "inference"
    return f"{kind}, {'dynamic' if dynamic else 'static'}"


@dataclasses.dataclass(frozen=True)
class PrecompiledArtifact:
    """A compiled model: callable with the model's arguments, savable to one file."""

    guards: Guards
    signature: dict[str, Any]
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
    # Where the artifact was saved to or loaded from ({"path": ...}); set by _io.
    _origin: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._runtime(args, kwargs)

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
        from ._pythonify import write_module

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
        lines.extend(f"  {line}" for line in _signature_lines(self.signature))
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
        sizes["compiled"] = len(_compat.serialize_compiled_function(artifact.compiled_function))
    except Exception as exc:  # a view must not fail because a size cannot be measured
        log.debug("could not measure the compiled function's size: %s", exc)
    mod = artifact.module
    if isinstance(mod, torch.nn.Module):
        from ._standin import module_tensors

        sizes["weights"] = sum(t.numel() * t.element_size() for t in module_tensors(mod).values())
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


def _signature_lines(sig: dict[str, Any]) -> list[str]:
    lines = []
    if "signature" in sig:
        lines.append(f"forward{sig['signature']}")
    for name, desc in sig.get("parameters", {}).items():
        lines.append(f"{name}: {_short(desc)}")
    sources = sig.get("graph_inputs")
    if sources:
        kinds = [describe_source(src).split(" ", 1)[0] for src in sources]
        counts = ", ".join(
            f"{kinds.count(k)} {k}{'s' if kinds.count(k) > 1 else ''}" for k in dict.fromkeys(kinds)
        )
        lines.append(f"graph inputs: {len(sources)} ({counts})")
    outs = sig.get("outputs")
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


# ------------------------------------------------------------ guard filter


_IDENTITY_KINDS = frozenset(
    {"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "CLASS_MATCH", "MODULE_MATCH"}
)


def serializable_guard_filter(
    dropped: list[str],
    translated: list[Guard] | None = None,
    scope_module: str | None = None,
    closure_names: Sequence[str] = (),
) -> Any:
    """Keep the guards that can be saved and re-checked in another process.

    Guards on object identities (ID_MATCH, FUNCTION_MATCH, CLOSURE_MATCH,
    CLASS_MATCH, MODULE_MATCH, and BUILTIN_MATCH built on ID_MATCH) are
    translated into savable ``identity`` entries of ``translated`` (a
    function by qualified name, file and bytecode hash). Guards on the *type*
    of a module are dropped: the artifact must also run on a stand-in of the
    model whose class cannot be imported; its weights, attribute values and
    module tree are still guarded. Every other guard that cannot be saved is
    dropped, and ``dropped`` gets ``"KIND name: why that is safe"``.
    """

    def guard_filter(entries: Sequence[Any]) -> list[bool]:
        keep = []
        for entry in entries:
            name, kind, is_global, value = _compat.guard_filter_entry_fields(entry)
            derived = _compat.guard_filter_entry_derived_kinds(entry)
            reason = _drop_reason(name, kind, derived, is_global, value)
            if reason is None:
                keep.append(True)
                continue
            keep.append(False)
            identity = kind in _IDENTITY_KINDS or "ID_MATCH" in derived
            guard = None
            if identity and translated is not None and not _is_module_class(value):
                source = _compat.guard_filter_entry_source(entry)
                guard = identity_guard(source, value, scope_module, closure_names)
            # Dynamo may call the filter more than once; record each guard once.
            if guard is not None:
                if all(g.subject != guard.subject for g in translated):  # type: ignore[union-attr]
                    translated.append(guard)  # type: ignore[union-attr]
            elif (line := f"{kind} {name}: {reason}".strip()) not in dropped:
                dropped.append(line)
        return keep

    return guard_filter


def _is_module_class(value: Any) -> bool:
    """A module's class (``self.block.__class__``): guarded by identity, it is the
    module's type, which the stand-in does not have."""
    return isinstance(value, type) and issubclass(value, torch.nn.Module)


def source_is_rechecked(name: str, is_global: bool) -> bool:
    """Whether guards on a source can be re-checked, with the same meaning, after load.

    Globals of the capturing process (library registries, module-level hooks
    and caches) and class attributes read through ``type(...)`` are not: they
    are filled differently in another process, or belong to a class the
    stand-in does not have.
    """
    return not is_global and "type(" not in name


# Why a guard is not saved, by category: (short label, why that is safe).
DROP_CATEGORIES = {
    "module type": (
        "module types",
        "the artifact also runs on a stand-in without the model's class; the module's "
        "weights, attributes and structure stay guarded",
    ),
    "class attribute": (
        "class attributes read through type()",
        "the traced bytecode and the defaults it read are saved in the artifact",
    ),
    "identity": (
        "object identities",
        "an identity of the capturing process; the attributes the compiled code read are "
        "guarded separately by value",
    ),
    "global": (
        "globals of the capturing process",
        "library registries, caches and module-level hooks differ between processes; the "
        "saved code resolves the modules it uses when loaded, with the torch version enforced",
    ),
}


def _drop_reason(
    name: str, kind: str, derived: tuple[str, ...], is_global: bool, value: Any
) -> str | None:
    """The :data:`DROP_CATEGORIES` key of a Dynamo guard that is not saved as it is
    (None: it is saved)."""
    if (kind in ("TYPE_MATCH", "ID_MATCH") and isinstance(value, torch.nn.Module)) or (
        _is_module_class(value)
    ):
        return "module type"
    if "type(" in name:
        return "class attribute"
    unserializable = _compat.UNSERIALIZABLE_GUARD_KINDS
    if kind in unserializable or any(d in unserializable for d in derived):
        return "identity"
    if is_global:
        return "global"
    return None


def _dropped_guard(dropped: list[str]) -> Guard:
    """One entry that records the guards not re-checked after load, by category.

    Logged once, in one line, at WARNING; each guard's name goes to DEBUG and
    into the entry, which ``inspect`` and ``as_text()`` show.
    """
    counts: dict[str, int] = {}
    for line in dropped:
        category = line.rpartition(": ")[2]
        counts[category] = counts.get(category, 0) + 1
    summary = ", ".join(f"{n} {DROP_CATEGORIES[c][0]}" for c, n in counts.items())
    log.warning(
        "precompile: %d guards are not re-checked after load (%s); see them with "
        "`torch-precompile inspect FILE`, or the torch_precompile logger at DEBUG",
        len(dropped),
        summary,
    )
    log.debug(
        "precompile: guards not re-checked after load:\n%s",
        "\n".join(
            f"  {line.rpartition(': ')[0]} ({DROP_CATEGORIES[line.rpartition(': ')[2]][1]})"
            for line in dropped
        ),
    )
    return Guard(
        "dynamo",
        "dropped",
        f"{len(dropped)} guards are not re-checked after load: {summary}",
        None,
        dropped,
    )


def bundle_variants(variants: Sequence[PrecompiledArtifact]) -> PrecompiledArtifact:
    """One artifact over several compiled variants of one model; a call runs the
    first variant whose guards hold (order is priority: put fast paths first)."""
    variants = tuple(variants)
    if not variants:
        raise ValueError("precompile() got an empty list; pass at least one variant")
    selves = {id(v.module) for v in variants}
    if len(selves) != 1:
        raise ValueError(
            "the variants bind different models; variants of one artifact must be captured from "
            "the same model object (they share its weights)"
        )
    first = variants[0]
    return dataclasses.replace(
        first,
        training=any(v.training for v in variants),
        timings={k: sum(v.timings.get(k, 0.0) for v in variants) for k in first.timings},
        _runtime=VariantRuntime(variants),  # type: ignore[arg-type]
        variants=variants,
    )


def precompile(compiled_or_inductor_output: Any) -> PrecompiledArtifact:
    """Bundle Inductor's output, Dynamo's bytecode and the final guards into an artifact.

    Given a list (of Inductor outputs or artifacts), returns one artifact
    holding each as a variant; see :func:`bundle_variants`.
    """
    if isinstance(compiled_or_inductor_output, (list, tuple)):
        return bundle_variants(
            [
                v if isinstance(v, PrecompiledArtifact) else precompile(v)
                for v in compiled_or_inductor_output
            ]
        )
    out = compiled_or_inductor_output
    if not isinstance(out, InductorOutput):
        out = getattr(compiled_or_inductor_output, "_torch_precompile_output", None)
        if not isinstance(out, InductorOutput):
            raise TypeError(
                "precompile() takes the output of Precompile.inductor (or the compiled object it "
                f"unpacked to), got {type(compiled_or_inductor_output).__name__}"
            )
    state = out._state
    capture = state.capture
    log.info("precompile: building guards and the compiled function")
    start = time.perf_counter()
    dropped: list[str] = []
    translated: list[Guard] = []
    scope_module = getattr(capture.traced_fn, "__module__", None)
    closure_names = capture.traced_fn.__code__.co_freevars
    guard_filter = serializable_guard_filter(dropped, translated, scope_module, closure_names)
    guard_manager, guards_state = _compat.build_guard_manager(
        capture, guard_filter, source_is_rechecked
    )
    compiled_function = _compat.make_compiled_function(
        capture, out.compiled, guard_manager, guards_state
    )
    elapsed = time.perf_counter() - start
    log.info("precompile: done in %.2f s", elapsed)
    guards = out.guards.extend(translated)
    # Ranges read after Inductor, so bounds added while lowering are included.
    guards = guards.extend(
        range_guards(
            _compat.shape_env_var_ranges(capture),
            _compat.shape_env_symbol_sources(capture),
            capture.size_oblivious,
        )
    )
    if dropped:
        guards = guards.extend([_dropped_guard(dropped)])
    signature = dict(state.input_signature)
    from ._signature import describe_graph_outputs

    signature["outputs"] = describe_graph_outputs(capture.graph_module)
    # Where each graph input comes from (L['x'], L['self']._modules[...]...), for views
    # and to_python after load.
    signature["graph_inputs"] = list(capture.input_sources)
    bound_self = capture.bound_self
    runtime = Runtime(compiled_function, guards, bound_self, out.training, state.grad_enabled)
    from . import _system

    return PrecompiledArtifact(
        guards=guards,
        signature=signature,
        system=_system.current_system(),
        training=out.training,
        device_type=capture.device_type,
        timings={**out._timings, "precompile": elapsed},
        bytecode=capture.graph_capture_output.bytecode,
        compiled_function=compiled_function,
        _runtime=runtime,
        globals_module=capture.traced_fn.__module__ or "",
    )
