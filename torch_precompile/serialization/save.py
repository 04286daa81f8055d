"""``Precompile.save``: an artifact, its weights and its kernels, in one file.

Sections written (docs/FORMAT.md): ``compiled`` (``compiled.<i>`` for variant
``i`` of a bundle), ``skeleton`` and ``weights`` for a module (``self`` for
another bound object), ``lean`` / ``lean.<i>`` where the lean path
applies, and one ``kernel/<key>`` section per shipped C++ kernel. The header is
a :class:`~.header.Header`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import _compat, lean_writer
from ..distributed.placement import describe as describe_layout
from ..distributed.shards import code_file_parts, save_shard
from ..file import sections as names
from ..file.header import Header, VariantRecord
from ..file.sections import KERNEL_PREFIX, section_name
from ..file.write import write_artifact
from ..guards import Guards, unmet_by
from ..lean.pickling import dumps as stable_dumps
from ..lean.standin import module as standin
from ..runtime.artifact import PrecompiledArtifact
from .extensions import EXTENSIONS
from .load_imports import file_imports

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
    parts = file_parts(artifact, bytecode, guards)
    if parts.tensors is not None and parts.layout is None:
        _warn_if_standin_falls_short(path, parts.artifact, parts.skeleton, parts.tensors)
    squeezed = [name for name in parts.sections if names.stored_compressed(name)]
    write_artifact(
        path, parts.header.to_json(), parts.sections, sign_key=sign_key, compressed=squeezed
    )
    if parts.layout is not None:
        save_shard(path, parts.artifact.module)  # the calling rank's shard file
    parts.artifact.saved_as(os.path.abspath(path), parts.header.created, parts.header.sizes)


@dataclasses.dataclass(frozen=True)
class FileParts:
    """What :func:`save` writes: the header and the sections (the weights left out when
    asked), the artifact saved (an extension's, such as a generator's step), and the
    bound module's skeleton, tensors and distributed layout."""

    artifact: PrecompiledArtifact
    header: Header
    sections: dict[str, bytes]
    skeleton: dict[str, Any] | None
    tensors: dict[str, torch.Tensor] | None
    layout: Any


def file_parts(
    obj: Any,
    bytecode: types.CodeType | None = None,
    guards: Guards | None = None,
    *,
    weights: bool = True,
) -> FileParts:
    """The file ``save`` writes for ``obj`` (an artifact, or an object an extension
    saves), in memory; ``weights=False``: without packing the weights (a check of
    what the file refers to, at build)."""
    artifact, extra_sections, serves_without = obj, {}, ()
    for kind in EXTENSIONS:  # a generator: its step, with the generator's records
        parts = kind.parts_to_save(obj)
        if parts is not None:
            artifact, extra_sections = parts
            serves_without = kind.serves_without
            break
    _check_save_arguments(artifact, bytecode, guards)
    variants = artifact.variants or (artifact,)
    sections: dict[str, bytes] = {
        section_name(names.COMPILED, i): _compat.serialize_compiled_function(v.compiled_function)
        for i, v in enumerate(variants)
    }
    bound = artifact.module
    kind = "function"
    layout = describe_layout(bound)  # None unless the model holds DTensors
    skeleton = tensors = None
    if isinstance(bound, torch.nn.Module):
        kind = "module"
        skeleton = standin.describe_module(bound, leave_out=serves_without)
        tensors = standin.module_tensors(bound)
        if layout is not None:  # shards go to per-rank files (save_shard)
            tensors, extra = code_file_parts(bound, tensors)
            sections.update(extra)
        sections[names.SKELETON] = json.dumps(skeleton).encode()
        sections[names.WEIGHTS] = standin.pack_tensors(tensors) if weights else b""
    elif bound is not None:
        kind = "object"
        sections[names.SELF] = stable_dumps(bound)

    # Each variant the lean path handles gets its "lean" section and brings its
    # kernels; the others' kernels (the artifact's own) go for PyTorch's full path.
    kernels: dict[str, bytes | memoryview] = {}
    refusals: list[str | None] = []
    slow: list[Any] = []
    for i, variant in enumerate(variants):
        fast, refusal = _lean_sections(variant)
        refusals.append(refusal)
        if fast is None:
            slow.append(variant)
            continue
        sections[section_name(names.LEAN, i)] = fast[0]
        kernels.update(fast[1])
    kernels.update(_full_path_kernels(slow))
    for key in sorted(kernels):
        sections[KERNEL_PREFIX + key] = kernels[key]

    sections.update(extra_sections)
    sizes = {n: len(data) for n, data in sections.items() if not n.startswith(KERNEL_PREFIX)}
    if kernels:
        sizes["kernels"] = sum(len(data) for data in kernels.values())
    records = tuple(_record(v, refusal) for v, refusal in zip(variants, refusals))
    # Names the compiled code reads from the model's module (e.g. an output dataclass).
    global_names = tuple(_compat.unresolved_globals(artifact.compiled_function))
    imports = file_imports(
        sections,
        [v.compiled_function for v in variants],
        [r.external_refs or {} for r in records],
        artifact.globals_module,
        global_names,
    )
    header = Header(
        producer=f"torch_precompile {PACKAGE_VERSION}",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        kind=kind,
        device_type=artifact.device_type,
        system=artifact.system,
        cudagraphs=_compat.compiled_function_uses_cudagraphs(artifact.compiled_function),
        bundle=bool(artifact.variants),
        variants=records,
        sizes=sizes,
        guards_text=_guards_text(artifact),
        globals_module=artifact.globals_module,
        global_names=global_names,
        distributed=layout.to_json() if layout is not None else None,
        imports=imports,
    )
    return FileParts(artifact, header, sections, skeleton, tensors, layout)


def _check_save_arguments(
    artifact: PrecompiledArtifact, bytecode: types.CodeType | None, guards: Guards | None
) -> None:
    """``bytecode`` and ``guards``, when given, must come from the artifact's capture."""
    if not isinstance(artifact, PrecompiledArtifact):
        raise TypeError(f"save() takes a PrecompiledArtifact, got {type(artifact).__name__}")
    if bytecode is not None and bytecode is not artifact.bytecode and bytecode != artifact.bytecode:
        raise ValueError(
            "the bytecode given to save() does not belong to this artifact's capture "
            f"({getattr(bytecode, 'co_name', type(bytecode).__name__)!r} vs the artifact's "
            f"{artifact.bytecode.co_name!r}); pass the bytecode Precompile.dynamo returned "
            "with this model"
        )
    if guards is None:
        return
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


def _record(variant: PrecompiledArtifact, lean_refusal: str | None) -> VariantRecord:
    return VariantRecord(
        training=variant.training,
        grad_enabled=variant.runtime.grad_enabled,
        signature=variant.signature.to_dict(),
        guards=tuple(variant.guards.to_json()),
        timings=variant.timings,
        external_refs=_compat.external_global_refs(variant.compiled_function),
        lean_refusal=lean_refusal,
    )


def _guards_text(artifact: PrecompiledArtifact) -> str:
    if not artifact.variants:
        return str(artifact.guards)
    return "\n".join(f"variant {i}:\n{v.guards}" for i, v in enumerate(artifact.variants))


def _warn_if_standin_falls_short(
    path: str | os.PathLike[str],
    artifact: PrecompiledArtifact,
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Say at save, not at the first call after load, when the stand-in rebuilt from
    the file would break a guard (an attribute the compiled code read that the file
    cannot carry, such as an object of a class defined in ``__main__``)."""
    # A bundle falls short only when no variant can be served.
    per_variant = unmet_by_standin(artifact, skeleton, tensors)
    problems = per_variant[0]
    if all(per_variant):
        log.warning(
            "%s: Precompile.load(path) without model= will refuse every call: the file "
            "cannot carry what %d guard(s) of the compiled code read (%s); load it "
            "with model=your_module, or make those attributes plain values",
            os.fspath(path),
            len(problems),
            "; ".join(problems),
        )


def unmet_by_standin(
    artifact: PrecompiledArtifact,
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    identities: bool = False,
) -> list[list[str]]:
    """Per variant, the guards that the stand-in rebuilt from the file's ``skeleton``
    and ``tensors`` breaks (``identities``: its identity guards too)."""
    rebuilt = standin.build_standin(json.loads(json.dumps(skeleton)), tensors)
    return [
        unmet_by(list(v.guards), rebuilt, identities=identities)
        for v in artifact.variants or (artifact,)
    ]


def _lean_sections(
    artifact: PrecompiledArtifact,
) -> tuple[tuple[bytes, Mapping[str, bytes | memoryview]] | None, str | None]:
    """The ``lean`` section and kernels that let a CPU or CUDA artifact (inference
    or training, or one variant of a bundle, bound to the bundle's model) load without
    a compiler, Inductor, AOTAutograd or Triton's compiler; or None and why not."""
    if artifact.device_type not in ("cpu", "cuda"):
        return None, f"device {artifact.device_type}"
    if artifact.variants:
        return None, "a bundle of variants"
    try:
        return lean_writer.lean_sections(
            artifact.compiled_function, artifact.kernels, artifact.lean_guards
        )
    except Exception as exc:  # never fail a save over the optional lean path
        log.warning("saving without shipped kernels (loading will need a C++ compiler): %s", exc)
        return None, f"{type(exc).__name__}: {exc}"


def _full_path_kernels(variants: Sequence[PrecompiledArtifact]) -> Mapping[str, bytes | memoryview]:
    """The C++ kernels of variants that load through PyTorch's full path, which then
    loads them instead of compiling (the union over variants, forward and backward).
    A CUDA graph may hold some too: a rank-dependent offset computed on the CPU."""
    if not variants:
        return {}
    try:
        return lean_writer.cpp_kernels([(v.compiled_function, v.kernels) for v in variants])
    except Exception as exc:  # never fail a save over shipped kernels
        log.warning("saving without shipped kernels (loading will need a C++ compiler): %s", exc)
        return {}
