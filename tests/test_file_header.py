"""The typed header of an artifact file: round trip, validation, version-1 headers.

No compilation: headers are built by hand, as ``Precompile.save`` builds them.
"""

from __future__ import annotations

import json

import pytest

from torch_precompile import ArtifactCorruptedError
from torch_precompile.file.header import Header, VariantRecord, section_name

GUARD = {"phase": "dynamo", "kind": "tensor", "expr": "input 'x': float32 (2, 3) on cpu"}


def _variant(training: bool = False, **changes) -> VariantRecord:
    fields = {
        "training": training,
        "grad_enabled": training,
        "signature": {"signature": "forward(self, x)", "parameters": {"x": {}}},
        "guards": (GUARD,),
        "timings": {"dynamo": 1.5, "inductor": 2.0},
        "external_refs": {"Out": ["app.models", "Out"]},
        "lean_refusal": None if not training else "training artifact: random ops",
        **changes,
    }
    return VariantRecord(**fields)


def _header(*variants: VariantRecord, **changes) -> Header:
    fields = {
        "producer": "torch_precompile 0.1.0",
        "created": "2026-11-23T10:00:00+00:00",
        "kind": "module",
        "device_type": "cpu",
        "system": {"torch": "2.13.0+cpu", "python": "3.11.7", "cpu_isa": "AVX2", "cuda": None},
        "cudagraphs": False,
        "bundle": len(variants) > 1,
        "variants": variants or (_variant(),),
        "sizes": {"compiled": 100, "weights": 4096, "kernels": 50_000},
        "guards_text": "dynamo (1):\n  input 'x'",
        "globals_module": "app.models",
        "global_names": ("Out",),
        **changes,
    }
    return Header(**fields)


@pytest.mark.parametrize(
    "header",
    [_header(), _header(_variant(), _variant(training=True)), _header(kind="function")],
    ids=["single", "bundle", "function"],
)
def test_round_trip_through_json(header: Header) -> None:
    text = json.dumps(header.to_json(), allow_nan=False)  # what the container stores
    again = Header.from_json(json.loads(text))
    assert again == header
    assert again.to_json() == header.to_json()


def test_views_of_a_bundle() -> None:
    header = _header(_variant(), _variant(training=True, timings={"dynamo": 0.5}))
    assert header.training  # any variant
    assert header.timings == {"dynamo": 2.0, "inductor": 2.0}  # summed, keys of variant 0
    assert not _header().training


def test_unknown_keys_are_ignored() -> None:
    """A newer writer may add keys without a format version bump."""
    data = _header().to_json()
    data["added_later"] = {"x": 1}
    data["variants"][0]["also_new"] = True
    assert Header.from_json(data) == _header()


def _broken(change) -> dict:
    data = _header(_variant(), _variant()).to_json()
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.pop("device_type"), "meta.device_type"),
        (lambda d: d.update(kind="lambda"), "meta.kind"),
        (lambda d: d.update(cudagraphs=1), "meta.cudagraphs"),
        (lambda d: d.update(system=["torch"]), "meta.system"),
        (lambda d: d.update(sizes={"weights": -1}), "meta.sizes"),
        (lambda d: d.update(sizes={"weights": True}), "meta.sizes"),
        (lambda d: d.update(variants=[]), "meta.variants"),
        (lambda d: d.update(bundle=False), "meta.variants"),  # two variants, no bundle
        (lambda d: d["variants"][1].update(training="yes"), "meta.variants[1].training"),
        (lambda d: d["variants"][0].update(guards=[{"phase": 1}]), "meta.variants[0].guards"),
        (lambda d: d["variants"][0].update(timings={"x": 1e300}), "meta.variants[0].timings"),
        (lambda d: d["variants"][0].update(external_refs={"a": 3}), "meta.variants[0].external"),
    ],
)
def test_invalid_fields_are_named(change, field: str) -> None:
    with pytest.raises(ArtifactCorruptedError) as info:
        Header.from_json(_broken(change), "model.pt")
    message = str(info.value)
    assert message.startswith("model.pt: the header field ") and f"'{field}" in message
    assert "re-save it with Precompile.save" in message and "\n" not in message


def test_section_names() -> None:
    assert [section_name("compiled", i) for i in range(3)] == [
        "compiled",
        "compiled.1",
        "compiled.2",
    ]
    assert section_name("lean", 0) == "lean"


def test_a_version_2_header_reads_its_names() -> None:
    """Format version 2 named the lean section "fastload" and its refusal
    "fast_load_refusal"; both are read, and written under their names now."""
    meta = _header(_variant(), _variant()).to_json()
    for variant in meta["variants"]:
        variant["fast_load_refusal"] = variant.pop("lean_refusal") or "why"
    old = Header.decode(2, meta, "old.pt")
    assert old.variants[0].lean_refusal == "why"
    assert (old.lean_section(0), old.lean_section(1)) == ("fastload", "fastload.1")
    new = Header.decode(3, old.to_json(), "new.pt")
    assert new.variants[0].lean_refusal == "why" and new.lean_section(1) == "lean.1"
    assert "fast_load_refusal" not in new.to_json()["variants"][0]


# ------------------------------------------------------------ version 1


V1_SINGLE = {
    "producer": "torch_precompile 0.1.0",
    "created": "2026-11-20T08:00:00+00:00",
    "kind": "module",
    "training": False,
    "grad_enabled": False,
    "device_type": "cpu",
    "system": {"torch": "2.13.0+cpu"},
    "signature": {"signature": "forward(self, x)"},
    "guards": [GUARD],
    "guards_text": "dynamo (1):",
    "sizes": {"compiled": 10, "kernels": 20},
    "timings": {"dynamo": 1.0},
    "external_refs": {},
    "globals": None,
    "cudagraphs": False,
    "fast_load_refusal": "training artifact: random ops",
}


def test_a_version_1_header_becomes_this_versions() -> None:
    header = Header.decode(1, V1_SINGLE, "old.pt")
    assert not header.bundle and len(header.variants) == 1
    (variant,) = header.variants
    assert variant == VariantRecord(
        training=False,
        grad_enabled=False,
        signature={"signature": "forward(self, x)"},
        guards=(GUARD,),
        timings={"dynamo": 1.0},
        external_refs={},
        lean_refusal="training artifact: random ops",
    )
    assert (header.kind, header.created, header.sizes) == (
        "module",
        "2026-11-20T08:00:00+00:00",
        {"compiled": 10, "kernels": 20},
    )
    # Version 1 made most keys optional: a bare header of a function still reads.
    bare = Header.decode(1, {"system": {}}, "old.pt")
    assert bare.kind == "function" and bare.variants[0].external_refs is None
    assert Header.decode(2, _header().to_json()) == _header()


def test_a_version_1_bundle_keeps_each_variant() -> None:
    meta = {
        **V1_SINGLE,
        "external_refs": {"Out": ["app", "Out"]},
        "variants": [
            {**{k: V1_SINGLE[k] for k in ("signature", "guards", "timings")}, "training": False},
            {
                "training": True,
                "grad_enabled": True,
                "signature": {},
                "guards": [],
                "timings": {"dynamo": 2.0},
                "external_refs": {"F": ["app", "F"]},
            },
        ],
    }
    header = Header.decode(1, meta)
    assert header.bundle and [v.training for v in header.variants] == [False, True]
    # Variant 0 read the top-level globals in version 1; the others their own.
    assert header.variants[0].external_refs == {"Out": ["app", "Out"]}
    assert header.variants[1].external_refs == {"F": ["app", "F"]}
    assert header.timings == {"dynamo": 3.0}


def test_a_damaged_version_1_header_is_named() -> None:
    with pytest.raises(ArtifactCorruptedError, match=r"'meta\.variants\[0\]\.signature'"):
        Header.decode(1, {**V1_SINGLE, "signature": 7}, "old.pt")
