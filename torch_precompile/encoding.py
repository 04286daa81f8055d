"""Sentence embeddings on one artifact: ``SentenceTransformer.encode`` calling a
precompiled forward.

``encode`` tokenizes a batch (padded to its longest sentence) inside
``torch.inference_mode()``, passes forward a ``BatchEncoding`` (a dict of
``input_ids``, ``attention_mask``, ... and a ``modality`` string), and reads
``sentence_embedding`` from the dict forward returns, which is the same dict
with the embeddings written into it. :func:`compile_for_encode` captures that
forward once, with a dynamic batch and padded length, on a plain dict of the
keys ``encode`` passes; :func:`encode_with` makes ``encode`` run on it::

    artifact = compile_for_encode(model, ["an example sentence", "another one"])
    Precompile.save("embedder.pt", artifact)
    loaded = Precompile.load("embedder.pt")  # or model=model for the live weights
    with encode_with(model, loaded):
        embeddings = model.encode(sentences)

Within the block each call gets a fresh plain dict of the captured keys (so a
dict that an earlier call wrote into is served again), with its tensors made
outside inference mode (a copy of the token ids), the artifact runs as it was
captured (``no_grad``, outside inference mode), and the outputs are written
into the caller's dict as the eager forward writes them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import Precompile, PrecompiledArtifact
from .stages.size_one import excluded_by_a_check
from .stages.snapshot import swapped_forward

log = logging.getLogger("torch_precompile")

__all__ = ["compile_for_encode", "encode_features", "encode_with"]


def encode_features(model: torch.nn.Module, sentences: Sequence[str]) -> dict[str, Any]:
    """The input dict ``model.encode(sentences)`` passes to forward, as a plain dict
    of tensors made outside inference mode (runs ``encode`` once, eagerly)."""
    seen: list[dict[str, Any]] = []
    forward = model.forward

    def spy(features: Any, **kwargs: Any) -> Any:
        if not seen:
            seen.append(plain_features(features))
        return forward(features, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    try:
        model.encode(list(sentences), batch_size=len(sentences))  # type: ignore[operator]
    finally:
        del model.forward
    if not seen:
        raise ValueError("encode did not call forward; pass at least one sentence")
    return seen[0]


def plain_features(features: Any, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """``features`` (a ``BatchEncoding`` or dict) as a new plain dict of ``keys`` (all
    if None); inference tensors are copied into normal ones."""
    out = {}
    with torch.inference_mode(False):
        for key in keys if keys is not None else list(features.keys()):
            value = features[key]
            if isinstance(value, torch.Tensor) and value.is_inference():
                value = value.clone()
            out[key] = value
    return out


def _resized(features: dict[str, Any], batch: int, length: int) -> dict[str, Any]:
    """``features`` with its (batch, length) tensors repeated or cut to that size."""
    out = {}
    for key, value in features.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            rows = value.repeat(-(-batch // value.shape[0]), -(-length // value.shape[1]))
            value = rows[:batch, :length].clone()
        out[key] = value
    return out


def compile_for_encode(
    model: torch.nn.Module,
    sentences: Sequence[str],
    *,
    mode: str | None = None,
    verbose: bool = False,
) -> PrecompiledArtifact:
    """One artifact for ``model.encode``: any batch size and padded length.

    ``sentences`` are examples (any, at least one). The capture is dynamic, at a
    batch and a length that equal no size of the weights (Dynamo would tie such a
    size to the weight's and specialise it), under ``torch.no_grad()``, with
    PyTorch's size-oblivious reasoning so that one variant also serves a batch of
    one sentence; calls under ``torch.inference_mode()`` are served through
    :func:`encode_with`.
    """
    features = encode_features(model, sentences)
    static = {int(d) for t in (*model.parameters(), *model.buffers()) for d in t.shape}
    batch = next(b for b in range(3, 10**6) if b not in static)
    length = next(n for n in range(batch + 2, 10**6) if n not in static and n - 1 not in static)
    example = _resized(features, batch, length)
    log.info("encode: compiling forward at batch %d, padded length %d (dynamic)", batch, length)

    def build(features: dict[str, Any]) -> PrecompiledArtifact:
        return Precompile.compile(
            model,
            (features,),
            dynamic=True,
            size_oblivious=True,  # batch 1 (one sentence) in the one variant's range
            size_one=False,
            mode=mode,
            verbose=verbose,
        )

    with torch.no_grad():
        artifact = build(example)
        if not excluded_by_a_check(artifact):
            return artifact
        # torch 2.11: attention's own check left batch 1 out (the length's range
        # starts at 2); one more variant serves one sentence.
        log.info("encode: compiling the variant for a batch of one sentence")
        return Precompile.precompile([artifact, build(_resized(features, 1, length))])


@contextlib.contextmanager
def encode_with(model: torch.nn.Module, artifact: PrecompiledArtifact) -> Iterator[None]:
    """Within the block, ``model.encode(...)`` and ``model(features)`` run on ``artifact``.

    ``artifact`` computes with its own weights: load it with
    ``Precompile.load(path, model=model)`` for the model's, or standalone for
    the file's. The model's own forward is back after the block.
    """
    keys = _captured_keys(artifact)

    def forward(features: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                "the artifact's forward takes the features dict only, got keywords "
                f"{sorted(kwargs)}"
            )
        # Run as captured (no_grad, outside inference mode): Dynamo's own guard manager,
        # where it decides, compares dispatch keys under the call's thread state.
        with torch.inference_mode(False), torch.no_grad():
            out = artifact(plain_features(features, keys))
        for key, value in out.items():
            if key not in keys:
                features[key] = value
        return features

    with swapped_forward(model, forward):
        yield


def _captured_keys(artifact: PrecompiledArtifact) -> list[str] | None:
    """The keys of the features dict the artifact was captured on (None: unknown)."""
    params = artifact.signature.parameters
    for desc in (params or {}).values():
        if isinstance(desc, dict) and isinstance(desc.get("dict"), dict):
            return list(desc["dict"])
    return None
