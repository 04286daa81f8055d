"""``Precompile.load``: decide from the header, then read the sections it needs.

A straight pipeline: open the file once and check and type its header
(:class:`~..file.opened.OpenedFile`), check the system it was built for and let each
extension of the file check this job (``serialization/extensions.py``: a generator,
a distributed job), bind the weights, rebuild every variant (:func:`_load_variant`),
and let the extensions finish what load returns. Sections are read, each checked
against its SHA-256, only when used (the weights not at all with ``model=``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import pickle
import time
from typing import Any

import torch

from .. import _compat, lean
from .._errors import ArtifactCorruptedError, GuardError, KernelDirectoryError
from .._stable import moved_modules_answered, today
from ..file import sections as names
from ..file import trace as _trace
from ..file.collector import no_cyclic_gc
from ..file.extension import FileExtension
from ..file.header import Header
from ..file.layout import (
    as_key,
    looks_like_artifact,
    looks_like_torch_compiled_file,
    open_regular,
)
from ..file.opened import OpenedFile
from ..file.sections import section_name
from ..guards import Guards, Source, TensorGuard, hooks_entry, unmet_by
from ..guards._python import dtype_name
from ..lean.standin import module as standin
from ..lean.standin.config import standins_in_guards
from ..runtime import machine as _system
from ..runtime.artifact import PrecompiledArtifact
from ..runtime.bundle import bundle_variants
from ..runtime.call import Runtime
from ..runtime.signature import CallSignature
from .extensions import EXTENSIONS

log = logging.getLogger("torch_precompile")


def load(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    mesh: Any = None,
    verify_key: bytes | str | None = None,
) -> PrecompiledArtifact:
    """Load an artifact; ``model=`` binds it to a live module instead of the saved weights.

    ``mesh=``: the DeviceMesh a distributed artifact runs on when loaded without
    ``model=`` (of the saved shape and dimension names); without it each such load
    builds one. Pass the same mesh to every load to keep one mesh in the process.
    """
    # Module paths the file holds that have moved since are answered; the cyclic
    # collector waits until the load's objects are built (file/collector.py).
    with moved_modules_answered(), no_cyclic_gc():
        return _load(os.fspath(path), model, mesh, verify_key)


def _load(path: str, model: Any, mesh: Any, verify_key: bytes | str | None) -> Any:
    """Read the header, check, bind the weights, rebuild each variant, then let the
    file's extensions (a generator, a distributed job) finish what load returns."""
    start = time.perf_counter()
    key = as_key(verify_key, "verify_key")  # a key of the wrong type: refused before any I/O
    f = open_regular(path)  # a pipe or device is refused, never waited on; opened once
    try:
        prefix = os.pread(f.fileno(), 16, 0)
    except BaseException:
        f.close()
        raise
    torch_file = not looks_like_artifact(prefix) and looks_like_torch_compiled_file(prefix)
    if torch_file and key is None:
        with f:
            return _load_torch_file(path, f.read(), model)
    # What runs beside the load (a generator's warm-up) ends, and is waited for, here.
    with contextlib.ExitStack() as beside:
        with OpenedFile.open(path, f, key) as file, contextlib.ExitStack() as reading:
            with _trace.phase("header"):
                _system.check_compatible(file.header.system, file.header.device_type, path=path)
                extensions = [e for kind in EXTENSIONS if (e := kind.for_file(file, model, mesh))]
                if mesh is not None and file.header.distributed is None:
                    log.warning("%s: not a distributed artifact; mesh= is ignored", path)
            for extension in extensions:
                beside.enter_context(extension.loading())
            if _compat.shipped_kernels_enabled():  # the kernels' files, written meanwhile
                reading.enter_context(lean.files_ahead(file.kernels))
            with _trace.phase("weights"):
                bound = _bind(file, model, extensions)
            with _trace.phase("guards"):
                guards = [Guards.from_json(list(r.guards)) for r in file.header.variants]
                if model is not None and file.header.kind == "module":
                    _check_model(file, guards, model)
            variants = _variants(file, guards, bound, extensions, model)
        artifact = bundle_variants(variants) if file.header.bundle else variants[0]
        artifact = dataclasses.replace(  # the loaded artifact, with where and how long it took
            artifact,
            timings={**artifact.timings, "load": time.perf_counter() - start},
            _origin={"path": os.path.abspath(path), "created": file.header.created},
        )
        for extension in extensions:  # a generator's file: the generator around its step
            artifact = extension.loaded(artifact)
    return artifact


def _variants(
    file: OpenedFile, guards: list[Guards], bound: Any, extensions: list[FileExtension], model: Any
) -> list[PrecompiledArtifact]:
    """Every variant of the file (the only one of a single artifact), rebuilt."""
    # A compile_on_one_rank graph holds a DeviceMesh: bound to this rank's mesh.
    # On saved weights, the guard state's dict configs are the stand-ins' class.
    with contextlib.ExitStack() as stack:
        for extension in extensions:
            stack.enter_context(extension.deserializing())
        if model is None:
            stack.enter_context(standins_in_guards())
        return [_load_variant(file, i, guards[i], bound) for i in range(len(file.header.variants))]


def _load_variant(file: OpenedFile, i: int, guards: Guards, bound: Any) -> PrecompiledArtifact:
    """Variant ``i`` of the file (the only one of a single artifact) as an artifact."""
    header, sections, kernels, path = file.header, file.sections, file.kernels, file.path
    record = header.variants[i]
    compiled = section_name(names.COMPILED, i)
    if compiled not in sections:
        raise ArtifactCorruptedError(
            f"{path}: variant {i} has no {compiled!r} section; re-save the artifact"
        )
    if record.external_refs is not None:
        f_globals = _compat.import_global_refs(record.external_refs) or None
    else:  # version-1 files written before external_refs: the model's whole module
        f_globals = _module_globals(header, path)
    compiled_function = _load_lean(file, f_globals, i)
    if compiled_function is None:
        if header.lean_section(i) not in sections:
            which = f"variant {i} loads" if header.bundle else "loading"
            log.info(
                "%s: %s through PyTorch's full path (Dynamo, AOTAutograd, Inductor): %s",
                path,
                which,
                record.lean_refusal or "the file has no lean section",
            )
        with _compat.shipped_cpp_kernels(kernels), _trace.phase("full path"):
            compiled_function = _compat.deserialize_compiled_function(
                sections[compiled],
                f_globals,
                cudagraphs=header.cudagraphs,
                hook_guards=hooks_entry(guards) is not None,
            )
    signature = CallSignature.from_dict(record.signature)
    return PrecompiledArtifact(
        guards=guards,
        signature=signature,
        system=header.system,
        training=record.training,
        device_type=header.device_type,
        timings=dict(record.timings),
        bytecode=_compat.compiled_function_bytecode(compiled_function),
        compiled_function=compiled_function,
        _runtime=Runtime(
            compiled_function,
            guards,
            bound,
            record.training,
            record.grad_enabled,
            signature,
        ),
        _sizes=dict(header.sizes),
        globals_module=header.globals_module,
        kernels=kernels,  # the file's: a re-save ships them again
    )


def _load_lean(file: OpenedFile, module_globals: dict[str, Any] | None, variant: int) -> Any:
    """The lean path of :mod:`..lean` for one variant, or None to load
    through PyTorch's full path."""
    sections, kernels, path = file.sections, file.kernels, file.path
    lean_section = file.header.lean_section(variant)
    if lean_section not in sections:
        return None
    # TORCH_PRECOMPILE_LEAN=0: the full path (TORCH_PRECOMPILE_FAST_LOAD, its old name, too)
    if os.environ.get("TORCH_PRECOMPILE_LEAN", os.environ.get("TORCH_PRECOMPILE_FAST_LOAD")) == "0":
        return None
    if not _compat.shipped_kernels_enabled():
        return None  # the user asked to compile the kernels: only the full path does
    suffix = section_name("", variant)
    try:
        return lean.load_lean_compiled_function(
            sections[lean_section],
            kernels,
            sections.reader_of(section_name(names.COMPILED, variant)),  # read to re-save only
            f"<torch_precompile {path}{suffix}>",
            module_globals,
        )
    except (KernelDirectoryError, ArtifactCorruptedError):
        # The full path would need the same directory (or a compiler), or the same bytes.
        raise
    except Exception as exc:
        log.warning(
            "%s: lean load failed, loading through PyTorch (%s: %s)", path, type(exc).__name__, exc
        )
        return None


def _module_globals(header: Header, path: str) -> dict[str, Any] | None:
    if not header.global_names:
        return None
    try:
        module = importlib.import_module(today(header.globals_module))
    except ImportError as exc:
        raise ImportError(
            f"{path}: the compiled code uses {', '.join(header.global_names)} from module "
            f"{header.globals_module!r}, which cannot be imported here ({exc}); make it "
            "importable (output types must be importable, as with pickle)"
        ) from exc
    return module.__dict__


def _bind(file: OpenedFile, model: Any, extensions: list[FileExtension]) -> Any:
    """What the compiled code runs on: ``model=``, else the saved weights (a stand-in
    module, or what an extension builds of them), or the pickled bound object."""
    kind, sections, path = file.header.kind, file.sections, file.path
    if kind == "module":
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"model= must be an nn.Module for this artifact, got {type(model).__name__}"
                )
            return model  # the weights in the file are not even read
        skeleton = json.loads(sections[names.SKELETON])
        weights, check = sections.copied_out(names.WEIGHTS)
        tensors = standin.unpack_tensors(weights, check=check)
        sections.forget(names.WEIGHTS)  # copied out: its pages leave this process
        for extension in extensions:  # a distributed file: DTensors from this rank's shard
            built = extension.weights(skeleton, tensors)
            if built is not None:
                return built
        return standin.build_standin(skeleton, tensors)
    if kind == "object":
        return model if model is not None else pickle.loads(sections[names.SELF])
    if model is not None:
        log.warning("%s: the artifact was captured from a function; model= is ignored", path)
    return None


def _check_model(file: OpenedFile, guards: list[Guards], model: Any) -> None:
    """Refuse ``model=`` when its module tree or a weight's shape differs from the
    model captured: the first difference, named (the calls would fail on it)."""
    if names.SKELETON not in file.sections:
        return
    problem = standin.tree_difference(json.loads(file.sections[names.SKELETON]), model)
    if problem is None:
        problem = _weight_shape_difference(guards, model)
    if problem is None:
        problem = _missing_attribute(guards, model)
    if problem is not None:
        raise GuardError(
            f"{file.path}: model= is not the model this artifact was captured from: {problem}; "
            "pass a model of the same architecture and configuration, or load without model= "
            "to use the file's own weights"
        )


def _weight_shape_difference(guards: list[Guards], model: torch.nn.Module) -> str | None:
    """The first parameter or buffer whose shape differs from the one its guard recorded."""
    for variant_guards in guards:
        for g in variant_guards.of_kind(TensorGuard):
            source = Source.parse(g.source)
            weight = source.weight() if source is not None else None
            if weight is None:
                continue
            table, name = weight
            try:
                t = model.get_parameter(name) if table == "parameters" else model.get_buffer(name)
            except AttributeError:
                continue  # the tree check names a missing one
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                continue  # a DTensor's local shard is checked by the distributed layout
            expected = tuple(s if isinstance(s, int) else -1 for s in g.shape)
            got = tuple(t.shape)
            if len(expected) != len(got) or any(e not in (-1, a) for e, a in zip(expected, got)):
                return f"{table[:-1]} {name!r} has shape {got}, the captured model's {g.shape}"
            if g.dtype and dtype_name(t.dtype) != g.dtype:
                return (
                    f"{table[:-1]} {name!r} has dtype {dtype_name(t.dtype)}, "
                    f"the captured model's {g.dtype}"
                )
    return None


def _missing_attribute(guards: list[Guards], model: torch.nn.Module) -> str | None:
    """The first attribute a guard of every variant reads that ``model`` lacks (another
    architecture: a Mistral for a Qwen2). Values that differ are left to the calls:
    a model may legitimately change them after load (``model.eval()``)."""
    per_variant = []
    for variant_guards in guards:
        missing = [p for p in unmet_by(list(variant_guards), model) if p.endswith(": missing")]
        if not missing:
            return None
        per_variant.append(missing[0])
    return per_variant[0] if per_variant else None


def _load_torch_file(path: str, data: bytes, model: Any) -> PrecompiledArtifact:
    """Files written by torch's own ``save_compiled_function`` (the ugly.py flow)."""
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
        signature=CallSignature(text=str(signature)),
        system={},
        training=False,
        device_type=_compat.compiled_function_device_type(compiled_function),
        timings={},
        bytecode=_compat.compiled_function_bytecode(compiled_function),
        compiled_function=compiled_function,
        _runtime=runtime,
    )
