"""Variants bundled into one artifact: a call runs the first whose guards hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from .artifact import PrecompiledArtifact, variant_label
from .call import VariantRuntime


def bundle_variants(variants: Sequence[PrecompiledArtifact]) -> PrecompiledArtifact:
    """One artifact over several compiled variants of one model; a call runs the
    first variant whose guards hold (order is priority: put fast paths first)."""
    # A bundle among the variants (a dynamic compile with its size-1 variants) is
    # spread out: one flat list, each variant loading on its own path.
    variants = tuple(v for a in variants for v in (a.variants or (a,)))
    if not variants:
        raise ValueError("precompile() got an empty list; pass at least one variant")
    if len({id(v.module) for v in variants}) != 1:
        raise ValueError(
            "the variants bind different models; variants of one artifact must be captured from "
            "the same model object (they share its weights)"
        )
    first = variants[0]
    runtime = VariantRuntime(variants, [variant_label(v) for v in variants])
    return dataclasses.replace(
        first,
        training=any(v.training for v in variants),
        timings={k: sum(v.timings.get(k, 0.0) for v in variants) for k in first.timings},
        _runtime=runtime,  # type: ignore[arg-type]
        variants=variants,
        kernels=_kernels_of(variants),
    )


def _kernels_of(variants: Sequence[PrecompiledArtifact]) -> Mapping[str, bytes | memoryview]:
    """The variants' kernels as one mapping. Variants loaded from one file share the
    file's (read when a re-save asks): that mapping itself, none of it read here."""
    distinct = list({id(v.kernels): v.kernels for v in variants}.values())
    if len(distinct) == 1:
        return distinct[0]
    return {key: data for kernels in distinct for key, data in kernels.items()}
