"""Save and load: our container around PyTorch's AOTCompiledFunction bytes."""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import pickle
import time
import types
from typing import Any

import torch

from . import _compat, _distributed, _format, _standin, _system
from ._artifact import PrecompiledArtifact, Runtime
from ._errors import ArtifactCorruptedError, KernelDirectoryError
from ._guards import Guards, hooked_modules, unmet_by

log = logging.getLogger("torch_precompile")

PACKAGE_VERSION = "0.1.0"


def save(
    path: str | os.PathLike[str],
    artifact: PrecompiledArtifact,
    bytecode: types.CodeType | None = None,
    guards: Guards | None = None,
    *,
    sign_key: bytes | str | None = None,
) -> None:
    """Write ``artifact`` to one file, atomically (weights included)."""
    if not isinstance(artifact, PrecompiledArtifact):
        raise TypeError(f"save() takes a PrecompiledArtifact, got {type(artifact).__name__}")
    if bytecode is not None and bytecode is not artifact.bytecode and bytecode != artifact.bytecode:
        raise ValueError(
            "the bytecode given to save() does not belong to this artifact's capture "
            f"({getattr(bytecode, 'co_name', type(bytecode).__name__)!r} vs the artifact's "
            f"{artifact.bytecode.co_name!r}); pass the bytecode Precompile.dynamo returned "
            "with this model"
        )
    if guards is not None:
        if not isinstance(guards, Guards):
            raise TypeError(f"guards must be a Guards collection, got {type(guards).__name__}")
        foreign = guards.capture_id is not None and guards.capture_id != artifact.guards.capture_id
        known = set(artifact.guards)
        missing = [g for g in guards if g not in known]
        if foreign or missing:
            what = (
                "another capture"
                if foreign
                else f"{len(missing)} entries the artifact lacks, e.g. {missing[0]}"
            )
            raise ValueError(
                "the guards given to save() do not belong to this artifact: "
                f"they come from {what}; "
                "pass the guards returned by the stages that built this artifact"
            )
    sections: dict[str, bytes] = {
        "compiled": _compat.serialize_compiled_function(artifact.compiled_function)
    }
    fast_refusal: str | None = None
    bound = artifact.module
    kind = "function"
    layout = _distributed.describe(bound)  # None unless the model holds DTensors
    if isinstance(bound, torch.nn.Module):
        kind = "module"
        skeleton = _standin.describe_module(bound)
        tensors = _standin.module_tensors(bound)
        if layout is not None:  # shards go to per-rank files (_distributed.save_shard)
            tensors, extra = _distributed.code_file_parts(bound, tensors)
            sections.update(extra)
        sections["skeleton"] = json.dumps(skeleton).encode()
        sections["weights"] = _standin.pack_tensors(tensors)
        if layout is None:
            _warn_if_standin_falls_short(path, artifact, skeleton, tensors)
    elif bound is not None:
        kind = "object"
        sections["self"] = pickle.dumps(bound, protocol=pickle.HIGHEST_PROTOCOL)
    if artifact.variants:
        # Each inference variant that qualifies gets its own fast-load section
        # ("fastload" for variant 0, "fastload.<i>" for variant i); the one
        # "kernels" section holds every variant's kernels.
        for i, variant in enumerate(artifact.variants):
            fast, _ = _fast_sections(variant, artifact.module)
            if fast is not None:
                sections["fastload" + (f".{i}" if i else "")] = fast[0]
        kernels = _kernel_section(artifact)
        if kernels is not None:
            sections["kernels"] = kernels
        else:
            for name in [n for n in sections if n.startswith("fastload")]:
                del sections[name]
    else:
        fast, fast_refusal = _fast_sections(artifact, artifact.module)
        if fast is not None:
            sections["fastload"], sections["kernels"] = fast
        else:
            kernels = _kernel_section(artifact)
            if kernels is not None:
                sections["kernels"] = kernels
    sizes = {name: len(data) for name, data in sections.items()}
    needs_globals = _compat.unresolved_globals(artifact.compiled_function)
    meta = {
        "producer": f"torch_precompile {PACKAGE_VERSION}",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kind": kind,
        "training": artifact.training,
        "grad_enabled": artifact._runtime.grad_enabled,
        "device_type": artifact.device_type,
        "system": artifact.system,
        "signature": artifact.signature,
        "guards": artifact.guards.to_json(),
        "guards_text": str(artifact.guards),
        "sizes": sizes,
        "timings": artifact.timings,
        "external_refs": _compat.external_global_refs(artifact.compiled_function),
        # Names the compiled code reads from the model's module (e.g. an output
        # dataclass): that module is imported at load, as pickle would.
        "globals": {"module": artifact.globals_module, "names": needs_globals}
        if needs_globals
        else None,
        "cudagraphs": _compat.compiled_function_uses_cudagraphs(artifact.compiled_function),
    }
    if layout is not None:
        meta["distributed"] = layout.to_json()
    if not artifact.variants and fast_refusal is not None:
        meta["fast_load_refusal"] = fast_refusal  # said at load, in one INFO line
    if artifact.variants:
        # Layout: "compiled" is variant 0, "compiled.<i>" variant i; weights are shared.
        meta["variants"] = []
        for i, variant in enumerate(artifact.variants):
            if i:
                data = _compat.serialize_compiled_function(variant.compiled_function)
                sections[f"compiled.{i}"] = data
                sizes[f"compiled.{i}"] = len(sections[f"compiled.{i}"])
            meta["variants"].append(
                {
                    "training": variant.training,
                    "grad_enabled": variant._runtime.grad_enabled,
                    "signature": variant.signature,
                    "guards": variant.guards.to_json(),
                    "timings": variant.timings,
                    "external_refs": _compat.external_global_refs(variant.compiled_function),
                }
            )
        meta["guards_text"] = "\n".join(
            f"variant {i}:\n{v.guards}" for i, v in enumerate(artifact.variants)
        )
    _format.write_artifact(path, meta, sections, sign_key=sign_key)
    if layout is not None:
        _distributed.save_shard(path, bound)
    artifact._sizes.clear()
    artifact._sizes.update(sizes)
    artifact._origin.update(path=os.path.abspath(path), created=meta["created"])


def _warn_if_standin_falls_short(
    path: str | os.PathLike[str],
    artifact: PrecompiledArtifact,
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Say at save, not at the first call after load, when the stand-in rebuilt from
    the file would break a guard (an attribute the compiled code read that the file
    cannot carry, such as an object of a class defined in ``__main__``)."""
    standin = _standin.build_standin(json.loads(json.dumps(skeleton)), tensors)
    guards = [g for v in artifact.variants or (artifact,) for g in v.guards]
    problems = unmet_by(guards, standin)
    if problems:
        log.warning(
            "%s: Precompile.load(path) without model= will refuse every call: the file "
            "cannot carry what %d guard(s) of the compiled code read (first: %s); load it "
            "with model=your_module, or make that attribute a plain value",
            os.fspath(path),
            len(problems),
            problems[0],
        )


def load(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    verify_key: bytes | str | None = None,
) -> PrecompiledArtifact:
    """Load an artifact; ``model=`` binds it to a live module instead of the saved weights."""
    path = os.fspath(path)
    prefix = _format.read_prefix(path, 16)  # a pipe or device is refused, never waited on
    if not _format.looks_like_artifact(prefix) and verify_key is None and prefix[:1] == b"\x80":
        return _load_torch_file(path, model)
    start = time.perf_counter()
    meta, sections = _format.read_artifact(path, verify_key=verify_key)
    _system.check_compatible(meta.get("system", {}), meta.get("device_type", "cpu"), path=path)
    layout = _distributed.check_job(meta.get("distributed"), path, model)
    if "compiled" not in sections:
        raise ArtifactCorruptedError(f"{path}: the artifact has no compiled section; re-save it")
    external_refs = meta.get("external_refs")
    if external_refs is not None:
        f_globals = _compat.import_global_refs(external_refs) or None
    else:  # files written before external_refs: the model's whole module
        f_globals = _module_globals(meta.get("globals"), path)
    guards = Guards.from_json(meta.get("guards", []))
    compiled_function = _load_fast(sections, path, f_globals)
    if compiled_function is None and "fastload" not in sections and not meta.get("variants"):
        log.info(
            "%s: loading through PyTorch's full path (Dynamo, AOTAutograd, Inductor): %s",
            path,
            meta.get("fast_load_refusal") or "the file has no fast-load section",
        )
    if compiled_function is None:
        with (
            _compat.shipped_cpu_kernels(sections.get("kernels")),
            _distributed.deserializing(layout, model, path),  # the live mesh for the graph
        ):
            compiled_function = _compat.deserialize_compiled_function(
                sections["compiled"],
                f_globals,
                cudagraphs=bool(meta.get("cudagraphs")),
                hook_guards=hooked_modules(guards) is not None,
            )
    bound = _bind(meta.get("kind"), sections, model, path, layout)
    training = bool(meta.get("training"))
    runtime = Runtime(compiled_function, guards, bound, training, meta.get("grad_enabled"))
    timings = dict(meta.get("timings", {}))
    if meta.get("variants"):
        return _load_variants(meta, sections, compiled_function, bound, path, start)
    timings["load"] = time.perf_counter() - start
    return PrecompiledArtifact(
        guards=guards,
        signature=meta.get("signature", {}),
        system=meta.get("system", {}),
        training=training,
        device_type=meta.get("device_type", "cpu"),
        timings=timings,
        bytecode=_compat.compiled_function_bytecode(compiled_function),
        compiled_function=compiled_function,
        _runtime=runtime,
        _sizes=dict(meta.get("sizes", {})),
        globals_module=(meta.get("globals") or {}).get("module", ""),
        _origin={"path": os.path.abspath(path), "created": meta.get("created")},
    )


def _fast_sections(
    artifact: PrecompiledArtifact, bound: Any
) -> tuple[tuple[bytes, bytes] | None, str | None]:
    """The shipped-kernel sections that let a CPU artifact (inference or training, or
    one variant of a bundle, bound to the bundle's model) load without a compiler,
    Inductor or AOTAutograd; or None and why not."""
    if artifact.device_type != "cpu":
        return None, f"device {artifact.device_type}"
    if artifact.variants:
        return None, "a bundle of variants"
    if _compat.compiled_function_uses_cudagraphs(artifact.compiled_function):
        return None, 'mode="reduce-overhead"'  # its runtime steps CUDA-graph generations
    try:
        # Kernels this process loaded from a file are read back, not rebuilt.
        with _compat.reusing_shipped_kernels():
            return _compat.cpu_fast_sections(artifact.compiled_function, bound)
    except Exception as exc:  # never fail a save over the optional fast path
        log.warning("saving without shipped kernels (loading will need a C++ compiler): %s", exc)
        return None, f"{type(exc).__name__}: {exc}"


def _kernel_section(artifact: PrecompiledArtifact) -> bytes | None:
    """The ``kernels`` section of a CPU artifact that does not take the fast path.

    One section for all variants (the union of their kernels, forward and
    backward): PyTorch's full path then loads them instead of compiling.
    """
    if artifact.device_type != "cpu":
        return None
    fns = [v.compiled_function for v in artifact.variants] or [artifact.compiled_function]
    try:
        return _compat.cpu_kernel_section(fns)
    except Exception as exc:  # never fail a save over shipped kernels
        log.warning("saving without shipped kernels (loading will need a C++ compiler): %s", exc)
        return None


def _load_fast(
    sections: dict[str, bytes],
    path: str,
    module_globals: dict[str, Any] | None,
    suffix: str = "",
) -> Any:
    """The fast path of :mod:`._compat.fastload`, or None to load through PyTorch's full path.

    ``suffix`` names a variant of a bundle (``".2"`` reads ``fastload.2`` and
    ``compiled.2``).
    """
    if "fastload" + suffix not in sections or "kernels" not in sections:
        return None
    if os.environ.get("TORCH_PRECOMPILE_FAST_LOAD", "1") == "0":
        return None
    if not _compat.shipped_kernels_enabled():
        return None  # the user asked to compile the kernels: only the full path does
    try:
        return _compat.load_fast_compiled_function(
            sections["fastload" + suffix],
            sections["kernels"],
            sections["compiled" + suffix],
            f"<torch_precompile {path}{suffix}>",
            module_globals,
        )
    except KernelDirectoryError:
        raise  # the full path would need the same directory, or a compiler
    except Exception as exc:
        log.warning(
            "%s: fast load failed, loading through PyTorch (%s: %s)", path, type(exc).__name__, exc
        )
        return None


def _load_variants(
    meta: dict[str, Any],
    sections: dict[str, bytes],
    first: Any,
    bound: Any,
    path: str,
    start: float,
) -> PrecompiledArtifact:
    """A bundle of variants (see ``Precompile.precompile([...])``), sharing one model."""
    from ._artifact import bundle_variants

    variants = []
    for i, vmeta in enumerate(meta["variants"]):
        guards = Guards.from_json(vmeta.get("guards", []))
        if i == 0:
            compiled_function = first
        else:
            if f"compiled.{i}" not in sections:
                raise ArtifactCorruptedError(
                    f"{path}: variant {i} has no compiled section; re-save it"
                )
            f_globals = _compat.import_global_refs(vmeta.get("external_refs") or {})
            compiled_function = _load_fast(sections, path, f_globals or None, f".{i}")
            if compiled_function is None:
                with _compat.shipped_cpu_kernels(sections.get("kernels")):
                    compiled_function = _compat.deserialize_compiled_function(
                        sections[f"compiled.{i}"],
                        f_globals or None,
                        cudagraphs=bool(meta.get("cudagraphs")),
                        hook_guards=hooked_modules(guards) is not None,
                    )
        training = bool(vmeta.get("training"))
        variants.append(
            PrecompiledArtifact(
                guards=guards,
                signature=vmeta.get("signature", {}),
                system=meta.get("system", {}),
                training=training,
                device_type=meta.get("device_type", "cpu"),
                timings=dict(vmeta.get("timings", {})),
                bytecode=_compat.compiled_function_bytecode(compiled_function),
                compiled_function=compiled_function,
                _runtime=Runtime(
                    compiled_function, guards, bound, training, vmeta.get("grad_enabled")
                ),
                _sizes=dict(meta.get("sizes", {})),
            )
        )
    bundle = bundle_variants(variants)
    bundle.timings["load"] = time.perf_counter() - start
    bundle._origin.update(path=os.path.abspath(path), created=meta.get("created"))
    return bundle


def _module_globals(spec: dict[str, Any] | None, path: str) -> dict[str, Any] | None:
    if not spec:
        return None
    try:
        module = importlib.import_module(spec["module"])
    except ImportError as exc:
        raise ImportError(
            f"{path}: the compiled code uses {', '.join(spec['names'])} from module "
            f"{spec['module']!r}, which cannot be imported here ({exc}); make it importable "
            "(output types must be importable, as with pickle)"
        ) from exc
    return module.__dict__


def _bind(
    kind: str | None,
    sections: dict[str, bytes],
    model: Any,
    path: str,
    layout: _distributed.Layout | None = None,
) -> Any:
    if kind == "module":
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"model= must be an nn.Module for this artifact, got {type(model).__name__}"
                )
            return model
        skeleton = json.loads(sections["skeleton"])
        tensors = _standin.unpack_tensors(sections["weights"])
        if layout is not None:
            return _distributed.build_standin(path, layout, skeleton, tensors, sections)
        return _standin.build_standin(skeleton, tensors)
    if kind == "object":
        return model if model is not None else pickle.loads(sections["self"])
    if model is not None:
        log.warning("%s: the artifact was captured from a function; model= is ignored", path)
    return None


def _load_torch_file(path: str, model: Any) -> PrecompiledArtifact:
    """Files written by torch's own ``save_compiled_function`` (the ugly.py flow)."""
    data = _format.read_file(path)
    try:
        compiled_function = _compat.deserialize_compiled_function(data)
    except Exception as exc:
        raise ArtifactCorruptedError(
            f"{path}: neither a torch_precompile artifact nor a file that torch's "
            "save_compiled_function "
            f"can read ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    signature = _compat.compiled_function_signature(compiled_function)
    takes_self = next(iter(signature.parameters), None) == "self"
    if takes_self and model is None:
        raise TypeError(
            f"{path} was written by torch's save_compiled_function, which does not carry the "
            "model's weights; load it with Precompile.load(path, model=your_module)"
        )
    # torch's file records neither the grad mode nor the guards in words: its own
    # guard manager decides, and its failures are reported in Dynamo's terms.
    runtime = Runtime(compiled_function, Guards(), model if takes_self else None, training=True)
    return PrecompiledArtifact(
        guards=runtime.guards,
        signature={"signature": str(signature)},
        system={},
        training=False,
        device_type=_compat.compiled_function_device_type(compiled_function),
        timings={},
        bytecode=_compat.compiled_function_bytecode(compiled_function),
        compiled_function=compiled_function,
        _runtime=runtime,
    )
