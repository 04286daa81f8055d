"""``Precompile.load``: decide from the header, then read the sections it needs.

The header is checked and typed first (:class:`~.header.Header`): format version,
fields, then the system the artifact was built for. Only then are sections
read, each checked against its SHA-256, and only those this load uses (the
weights not at all when ``model=`` is given). Every variant, of a single
artifact or of a bundle, is rebuilt by :func:`_load_variant`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .. import _compat, _trace, lean
from .._errors import ArtifactCorruptedError, GuardError, KernelDirectoryError
from .._names import moved_modules_answered, today
from ..distributed.binding import build_standin, check_job, deserializing
from ..distributed.placement import Layout
from ..file import sections as names
from ..file.header import Header
from ..file.layout import looks_like_artifact, looks_like_torch_compiled_file, open_regular
from ..file.reader import ArtifactReader, open_artifact
from ..file.sections import KERNEL_PREFIX, section_name
from ..guards import Guards, Source, TensorGuard, hooks_entry, unmet_by
from ..guards._python import dtype_name
from ..runtime import generator as _generator
from ..runtime import machine as _system
from ..runtime.artifact import PrecompiledArtifact
from ..runtime.bundle import bundle_variants
from ..runtime.call import Runtime
from ..runtime.signature import CallSignature
from ..standin import module as standin
from ..standin.config import standins_in_guards

log = logging.getLogger("torch_precompile")

Kernels = Mapping[str, bytes | memoryview]


def load(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    verify_key: bytes | str | None = None,
) -> PrecompiledArtifact:
    """Load an artifact; ``model=`` binds it to a live module instead of the saved weights."""
    with moved_modules_answered():  # module paths the file holds that have moved since
        return _load(os.fspath(path), model, verify_key)


def _load(path: str, model: Any, verify_key: bytes | str | None) -> PrecompiledArtifact:
    f = open_regular(path)  # a pipe or device is refused, never waited on; opened once
    start = time.perf_counter()
    try:
        prefix = os.pread(f.fileno(), 16, 0)
        if (
            not looks_like_artifact(prefix)
            and verify_key is None
            and looks_like_torch_compiled_file(prefix)
        ):
            with f:
                return _load_torch_file(path, f.read(), model)
        with _trace.phase("header"):
            reader = open_artifact(path, verify_key=verify_key, opened=f)
    except BaseException:
        f.close()
        raise
    try:
        with _trace.phase("header"):
            header = Header.decode(reader.info.format_version, reader.info.meta, path)
            _system.check_compatible(header.system, header.device_type, path=path)
            layout = check_job(header.distributed, path, model)
        sections = _Sections(reader)
        kernels = _kernels(reader.info.format_version, sections)
        with _trace.phase("weights"):
            bound = _bind(header.kind, sections, model, path, layout)
        with _trace.phase("guards"):
            guards = [Guards.from_json(list(record.guards)) for record in header.variants]
            if model is not None and header.kind == "module" and names.SKELETON in sections:
                _check_model(json.loads(sections[names.SKELETON]), guards, model, path)
        # A compile_on_one_rank graph holds a DeviceMesh: bound to this rank's mesh.
        # On saved weights, the guard state's dict configs are the stand-ins' class.
        with (
            deserializing(layout, model, path),
            standins_in_guards() if model is None else contextlib.nullcontext(),
        ):
            variants = [
                _load_variant(header, i, guards[i], sections, kernels, bound, path)
                for i in range(len(header.variants))
            ]
        generator = _generator.records(sections, path)
        reader.finish()  # the weights' checksum, computed while they were copied out
    except BaseException as exc:
        try:
            reader.finish()  # bytes that fail their checksum explain any error above
        except ArtifactCorruptedError as corrupt:
            raise corrupt from exc
        finally:
            reader.close()
        raise
    reader.settle()  # a re-save reads compiled from the bytes loaded, later
    artifact = bundle_variants(variants) if header.bundle else variants[0]
    artifact = dataclasses.replace(  # the loaded artifact, with where and how long it took
        artifact,
        timings={**artifact.timings, "load": time.perf_counter() - start},
        _origin={"path": os.path.abspath(path), "created": header.created},
    )
    if generator is not None:  # compile_generator's file: the generator around its step
        return _generator.from_sections(artifact, *generator, path)
    return artifact


class _Sections:
    """The file's sections by name, each read and checked once, when first asked for
    (the reader keeps them); a section no one asks for is never read."""

    def __init__(self, reader: ArtifactReader) -> None:
        self._reader = reader
        self._names = set(reader.names())

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _need(self, name: str) -> None:
        if name not in self._names:
            raise ArtifactCorruptedError(
                f"{self._reader.path}: the artifact has no {name!r} section; re-save it"
            )

    def __getitem__(self, name: str) -> bytes:
        self._need(name)
        return self._reader.read(name)

    def mapped(self, name: str) -> memoryview:
        """Section ``name`` as a checked read-only view of the mapped file (no copy)."""
        self._need(name)
        return self._reader.view(name)

    def copied_out(self, name: str) -> memoryview:
        """Section ``name`` as a view of the mapped file to copy out at once, its checksum
        computed meanwhile on a thread and checked before ``load`` returns."""
        self._need(name)
        return self._reader.view_checked_beside(name)

    def forget(self, name: str) -> None:
        """Section ``name`` was copied out and is not needed again (the weights)."""
        self._reader.forget(name)

    def reader_of(self, name: str) -> Callable[[], bytes]:
        """Reads section ``name`` when called (after the load too: the file stays open)."""
        self._need(name)
        return functools.partial(self._reader.read, name)

    def names(self) -> list[str]:
        return self._reader.names()


class _ShippedKernels(Mapping[str, memoryview]):
    """The ``kernel/<key>`` sections by key, each read and checked when a graph first
    asks for it; :meth:`sha256` and :meth:`length` answer from the checked header,
    so naming the kernel directory and finding a kernel already in it read nothing."""

    def __init__(self, sections: _Sections) -> None:
        self._sections = sections
        self._entries = {
            entry["name"][len(KERNEL_PREFIX) :]: entry
            for entry in sections._reader.info.sections
            if entry["name"].startswith(KERNEL_PREFIX)
        }

    def __getitem__(self, key: str) -> memoryview:
        if key not in self._entries:
            raise KeyError(key)
        return self._sections.mapped(KERNEL_PREFIX + key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries  # Mapping's would read the kernel

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def sha256(self, key: str) -> str:
        entry = self._entries[key]  # a kernel of 64 MiB or more has a tree digest
        return str(entry.get("sha256") or entry["sha256_tree"])

    def length(self, key: str) -> int:
        return int(self._entries[key]["length"])


def _kernels(format_version: int, sections: _Sections) -> Kernels:
    """The shipped kernels, ``{key: shared object}``: one ``kernel/<key>`` section each
    (format version 1 nested them in one ``kernels`` section)."""
    if format_version == 1:
        return _v1_kernels(sections[names.KERNELS_V1]) if names.KERNELS_V1 in sections else {}
    return _ShippedKernels(sections)


def _v1_kernels(data: bytes) -> dict[str, bytes | memoryview]:
    """Format version 1's ``kernels`` section: ``u64 L | JSON {key: [offset, length]} | bytes``."""
    n = int.from_bytes(data[:8], "little")
    try:
        index = json.loads(data[8 : 8 + n])
        view = memoryview(data)[8 + n :]
        return {key: view[off : off + length] for key, (off, length) in index.items()}
    except (ValueError, TypeError) as exc:
        raise ArtifactCorruptedError(
            f"the kernels section is malformed ({exc}); re-save it"
        ) from None


def _load_variant(
    header: Header,
    i: int,
    guards: Guards,
    sections: _Sections,
    kernels: Kernels,
    bound: Any,
    path: str,
) -> PrecompiledArtifact:
    """Variant ``i`` of the file (the only one of a single artifact) as an artifact."""
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
    compiled_function = _load_lean(sections, kernels, path, f_globals, i, header.lean_section(i))
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


def _load_lean(
    sections: _Sections,
    kernels: Kernels,
    path: str,
    module_globals: dict[str, Any] | None,
    variant: int,
    lean_section: str,
) -> Any:
    """The lean path of :mod:`..lean` for one variant, or None to load
    through PyTorch's full path."""
    if lean_section not in sections or not kernels:
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


def _bind(
    kind: str,
    sections: _Sections,
    model: Any,
    path: str,
    layout: Layout | None = None,
) -> Any:
    if kind == "module":
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"model= must be an nn.Module for this artifact, got {type(model).__name__}"
                )
            return model  # the weights in the file are not even read
        skeleton = json.loads(sections[names.SKELETON])
        tensors = standin.unpack_tensors(sections.copied_out(names.WEIGHTS))
        sections.forget(names.WEIGHTS)  # copied out: its pages leave this process
        if layout is not None:  # DTensors from this rank's own shard file
            return build_standin(path, layout, skeleton, tensors, sections)
        return standin.build_standin(skeleton, tensors)
    if kind == "object":
        return model if model is not None else pickle.loads(sections[names.SELF])
    if model is not None:
        log.warning("%s: the artifact was captured from a function; model= is ignored", path)
    return None


def _check_model(skeleton: dict[str, Any], guards: list[Guards], model: Any, path: str) -> None:
    """Refuse ``model=`` when its module tree or a weight's shape differs from the
    model captured: the first difference, named (the calls would fail on it)."""
    problem = standin.tree_difference(skeleton, model)
    if problem is None:
        problem = _weight_shape_difference(guards, model)
    if problem is None:
        problem = _missing_attribute(guards, model)
    if problem is not None:
        raise GuardError(
            f"{path}: model= is not the model this artifact was captured from: {problem}; "
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
