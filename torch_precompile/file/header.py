"""The typed header ``Precompile.save`` writes: what the file holds, read back once.

A :class:`Header` is the ``meta`` object of the container (:mod:`.layout`);
:meth:`Header.to_json` and :meth:`Header.from_json` sit side by side, and
``from_json`` validates every field once, so code after it reads typed
attributes, never ``meta.get(key, default)``. A file of format version 1 had a
flatter header; :meth:`Header.from_v1_json` turns it into this one.

Every file, one compiled function or a bundle of variants, lists its variants
(one :class:`VariantRecord` each); variant ``i`` lives in the sections named by
:func:`section_name`. Only ``json`` and the package's errors are imported: the
command line reads headers without torch's compiler.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .._errors import ArtifactCorruptedError
from .layout import FORMAT_VERSION
from .sections import KERNEL_PREFIX, section_name
from .sections import LEAN as LEAN_SECTION

__all__ = ["KERNEL_PREFIX", "Header", "VariantRecord", "section_name"]

KINDS = ("module", "object", "function")
_MAX_NUMBER = 1e18  # a size or time beyond this is a damaged or hand-made header


# Why a variant has no lean section; format versions 1 and 2 named the section and
# this key "fastload" and "fast_load_refusal".
LEAN_REFUSAL = "lean_refusal"
_BEFORE_3 = {LEAN_SECTION: "fastload", LEAN_REFUSAL: "fast_load_refusal"}


def on_disk(name: str, format_version: int) -> str:
    """The name a file of ``format_version`` uses for ``name`` (a section or key)."""
    return _BEFORE_3.get(name, name) if format_version < 3 else name


class _Bad(Exception):
    """A header field that is not what torch_precompile writes (``field``, ``problem``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class VariantRecord:
    """One compiled variant: how it was captured, its guards and its input/output signature."""

    training: bool
    grad_enabled: bool | None  # None: a version-1 file that did not record it
    signature: dict[str, Any]
    guards: tuple[dict[str, Any], ...]  # ``Guards.to_json()`` entries
    timings: dict[str, float]
    # Globals the compiled code reads, ``{name: [module, qualified name]}``, imported
    # at load; None only in version-1 files written before they were recorded.
    external_refs: dict[str, list[str]] | None
    lean_refusal: str | None = None  # why no ``lean`` section (None: there is one)

    def to_json(self) -> dict[str, Any]:
        return {
            "training": self.training,
            "grad_enabled": self.grad_enabled,
            "signature": self.signature,
            "guards": list(self.guards),
            "timings": self.timings,
            "external_refs": self.external_refs,
            LEAN_REFUSAL: self.lean_refusal,
        }

    @classmethod
    def from_json(cls, data: Any, where: str, version: int = FORMAT_VERSION) -> VariantRecord:
        data = _object(data, where)
        refs = data.get("external_refs")
        if refs is not None:
            refs = _object(refs, f"{where}.external_refs")
            for name, ref in refs.items():
                if not (isinstance(ref, list) and len(ref) == 2 and all(_is_str(r) for r in ref)):
                    raise _Bad(f"{where}.external_refs", f"{name!r} is not [module, name]")
        return cls(
            training=_typed(data, "training", bool, where),
            grad_enabled=_typed(data, "grad_enabled", (bool, type(None)), where),
            signature=_object(data.get("signature"), f"{where}.signature"),
            guards=_guards(data.get("guards"), f"{where}.guards"),
            timings=_numbers(data.get("timings"), f"{where}.timings", float),
            external_refs=refs,
            lean_refusal=_typed(data, on_disk(LEAN_REFUSAL, version), (str, type(None)), where),
        )


@dataclasses.dataclass(frozen=True)
class Header:
    """The metadata of an artifact file (the container's ``meta``), validated."""

    producer: str
    created: str  # ISO 8601, UTC
    kind: str  # what the compiled code reads as ``self``: "module", "object" or "function"
    device_type: str
    system: dict[str, Any]  # ``_system.current_system()`` of the saving process
    cudagraphs: bool  # compiled with mode="reduce-overhead"
    bundle: bool  # ``Precompile.precompile([...])``: a call runs the first variant that fits
    variants: tuple[VariantRecord, ...]
    sizes: dict[str, int]  # bytes per section; "kernels" is every kernel section together
    guards_text: str
    globals_module: str = ""  # the traced function's module
    global_names: tuple[str, ...] = ()  # names the code reads from it (version-1 fallback)
    # A model of DTensors: world size, mesh, placements, shard files (``_distributed.Layout``).
    distributed: dict[str, Any] | None = None
    # The modules a load imports, ``{"load"|"fallback": {module: [places]}}``
    # (``serialization/load_imports.py``); None: a file written before they were recorded.
    imports: dict[str, dict[str, list[str]]] | None = None
    # The format version of the file it was read from (not written: the container's).
    format_version: int = dataclasses.field(default=FORMAT_VERSION, compare=False)

    def lean_section(self, variant: int) -> str:
        """The name of variant ``variant``'s lean section in this file."""
        return section_name(on_disk(LEAN_SECTION, self.format_version), variant)

    @property
    def training(self) -> bool:
        return any(v.training for v in self.variants)

    @property
    def timings(self) -> dict[str, float]:
        """Stage timings; summed over the variants of a bundle."""
        first = self.variants[0].timings
        return {k: sum(v.timings.get(k, 0.0) for v in self.variants) for k in first}

    def to_json(self) -> dict[str, Any]:
        return {
            "producer": self.producer,
            "created": self.created,
            "kind": self.kind,
            "device_type": self.device_type,
            "system": self.system,
            "cudagraphs": self.cudagraphs,
            "bundle": self.bundle,
            "variants": [v.to_json() for v in self.variants],
            "sizes": self.sizes,
            "guards_text": self.guards_text,
            "globals_module": self.globals_module,
            "global_names": list(self.global_names),
            "distributed": self.distributed,
            **({"imports": self.imports} if self.imports is not None else {}),
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], path: str = "the artifact", version: int = FORMAT_VERSION
    ) -> Header:
        """Validate ``data`` (a header of format ``version``, 2 or later) into a :class:`Header`.

        Keys this version does not know are ignored (a newer writer may add
        some); a missing or mistyped field raises :class:`ArtifactCorruptedError`
        naming it, before anything is read from the sections.
        """
        try:
            return cls._from_json(data, version)
        except _Bad as bad:
            raise ArtifactCorruptedError(
                f"{path}: the header field 'meta.{bad.field}' {bad.problem}, which is not what "
                "torch_precompile writes: the file was made or edited by something else; "
                "re-save it with Precompile.save"
            ) from None

    @classmethod
    def _from_json(cls, data: Mapping[str, Any], version: int) -> Header:
        kind = _typed(data, "kind", str, "")
        if kind not in KINDS:
            raise _Bad("kind", f"is {kind!r}, not one of {', '.join(KINDS)}")
        variants = data.get("variants")
        if not isinstance(variants, list) or not variants:
            raise _Bad("variants", "is not a non-empty list")
        bundle = _typed(data, "bundle", bool, "")
        if not bundle and len(variants) != 1:
            raise _Bad("variants", f"lists {len(variants)} variants in a file that is no bundle")
        names = data.get("global_names", [])
        if not isinstance(names, list) or not all(_is_str(n) for n in names):
            raise _Bad("global_names", "is not a list of strings")
        return cls(
            producer=_typed(data, "producer", str, ""),
            created=_typed(data, "created", str, ""),
            kind=kind,
            device_type=_typed(data, "device_type", str, ""),
            system=_object(data.get("system"), "system"),
            cudagraphs=_typed(data, "cudagraphs", bool, ""),
            bundle=bundle,
            variants=tuple(
                VariantRecord.from_json(v, f"variants[{i}]", version)
                for i, v in enumerate(variants)
            ),
            sizes=_numbers(data.get("sizes"), "sizes", int),
            guards_text=_typed(data, "guards_text", str, ""),
            globals_module=_typed(data, "globals_module", str, ""),
            global_names=tuple(names),
            distributed=_object(data["distributed"], "distributed")
            if data.get("distributed") is not None
            else None,
            imports=_imports(data.get("imports")),
            format_version=version,
        )

    @classmethod
    def from_v1_json(cls, meta: Mapping[str, Any], path: str = "the artifact") -> Header:
        """The header of a format-version-1 file, as this version's :class:`Header`.

        Version 1 kept one variant's fields at the top level and a bundle's in
        ``variants``; most keys were optional then, with these defaults.
        """

        def variant(entry: Any, refs: Any) -> Any:
            if not isinstance(entry, dict):
                return entry  # from_json names it
            return {
                "training": bool(entry.get("training")),
                "grad_enabled": entry.get("grad_enabled"),
                "signature": entry.get("signature", {}),
                "guards": entry.get("guards", []),
                "timings": entry.get("timings", {}),
                "external_refs": refs,
                "fast_load_refusal": entry.get("fast_load_refusal"),
            }

        listed = meta.get("variants")
        bundle = isinstance(listed, list) and bool(listed)
        entries = listed if bundle else [meta]
        # Variant 0 (a bundle's too) used the top-level globals; the others their own.
        variants = [
            variant(
                e,
                meta.get("external_refs")
                if i == 0
                else (e.get("external_refs") if isinstance(e, dict) else None) or {},
            )
            for i, e in enumerate(entries)
        ]
        spec = meta.get("globals") or {}
        v2 = {
            "producer": meta.get("producer", "torch_precompile (format version 1)"),
            "created": meta.get("created", ""),
            "kind": meta.get("kind") or "function",
            "device_type": meta.get("device_type", "cpu"),
            "system": meta.get("system", {}),
            "cudagraphs": bool(meta.get("cudagraphs")),
            "bundle": bundle,
            "variants": variants,
            "sizes": meta.get("sizes", {}),
            "guards_text": meta.get("guards_text", ""),
            "globals_module": spec.get("module", "") if isinstance(spec, dict) else "",
            "global_names": spec.get("names", []) if isinstance(spec, dict) else [],
        }
        return cls.from_json(v2, path, version=1)

    @classmethod
    def decode(
        cls, format_version: int, meta: Mapping[str, Any], path: str = "the artifact"
    ) -> Header:
        """The header (``meta``) of a checked file of any version this package reads."""
        if format_version == 1:
            return cls.from_v1_json(meta, path)
        return cls.from_json(meta, path, format_version)


# ------------------------------------------------------------------ checks


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _typed(data: Mapping[str, Any], key: str, types: Any, where: str) -> Any:
    field = f"{where}.{key}" if where else key
    if key not in data:
        if isinstance(types, tuple) and type(None) in types:
            return None
        raise _Bad(field, "is missing")
    value = data[key]
    # type() for bool: JSON's true must not pass as an int, nor 1 as true.
    allowed = types if isinstance(types, tuple) else (types,)
    if type(value) not in allowed:
        raise _Bad(field, f"is a {type(value).__name__}")
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(field, f"is a {type(value).__name__}, not an object")
    return value


def _numbers(value: Any, field: str, kind: type) -> dict[str, Any]:
    """A ``{name: number}`` object of sizes (ints) or seconds (floats), each in range."""
    value = _object(value, field)
    for name, number in value.items():
        ok = type(number) is int or (kind is float and type(number) is float)
        if not ok:
            raise _Bad(field, f"holds {type(number).__name__} for {name!r}, not a number")
        if not (math.isfinite(number) and 0 <= number < _MAX_NUMBER):
            raise _Bad(field, f"holds {number!r:.40} for {name!r}, out of range")
    return value


def _imports(value: Any) -> dict[str, dict[str, list[str]]] | None:
    """``meta.imports``: ``{"load"|"fallback": {module: [place, ...]}}``, or None."""
    if value is None:
        return None
    value = _object(value, "imports")
    for part in ("load", "fallback"):
        for module, places in _object(value.get(part), f"imports.{part}").items():
            if not (isinstance(places, list) and all(_is_str(p) for p in places)):
                raise _Bad(f"imports.{part}", f"holds {places!r:.80} for {module!r}")
    return value


def _guards(value: Any, field: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise _Bad(field, f"is a {type(value).__name__}, not a list")
    for entry in value:
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), str) for k in ("phase", "kind", "expr")
        ):
            raise _Bad(field, f"holds {entry!r:.80}, not a {{phase, kind, expr}} object")
    return tuple(value)
