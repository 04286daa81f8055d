"""What a generator file records beside its step (:class:`GeneratorSpec`): limits, cache
layout, token ids, chat template, and the model's ``generation_config`` settings a call
that leaves them out gets, as transformers' ``generate`` gives them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._errors import ArtifactCorruptedError
from ..file.sections import GENERATOR

# transformers' generate: what neither the call nor the model's generation_config sets
# (GenerationConfig's global defaults). The keys are the sampling settings a generator
# file records from the model's generation_config.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "repetition_penalty": 1.0,
}


# transformers' generate, when neither the call nor the model's generation_config says
# how long: this many new tokens. The config's length settings a generator file records:
LENGTH_KEYS = ("max_new_tokens", "max_length")
DEFAULT_NEW_TOKENS = 20


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """What a generator file records beside its step: limits, cache layout, token ids."""

    max_batch: int
    max_length: int
    kv_shapes: tuple[
        tuple[int, int], ...
    ]  # per cache tensor, keys and values of each layer: (heads, head_dim)
    dtype: str  # the cache's dtype, e.g. "float32"
    device: str
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    model_type: str = ""
    # A slot decode step (``start`` of shape ``(batch,)``, each row its own offset)
    # is bundled: ``serve`` batches requests continuously. Files before it: False.
    slots: bool = False
    # generate's decode steps (and a one-token prompt) run the slot step, its padding
    # masked, and the file holds no decode step of its own (generation/rows.py). Files
    # before it: False.
    decode_by_slots: bool = False
    # The tokenizer's chat template (jinja) and the special tokens it names.
    chat_template: str | None = None
    chat_tokens: tuple[tuple[str, str], ...] = ()
    # The model's generation_config where it sets a key of SAMPLING_DEFAULTS (what
    # generate and serve use when a call leaves that setting out). Files before it: ().
    sampling: tuple[tuple[str, Any], ...] = ()
    # The model's generation_config where it sets a key of LENGTH_KEYS (how many tokens
    # a call that does not say generates). Files before it: ().
    lengths: tuple[tuple[str, int], ...] = ()
    # Weight-only quantization of the decoder's linear layers (compile_generator's
    # ``weights``): "int8" or "int4", "" for the model's own dtype (files before it);
    # the inputs one scale covers (0: a whole row), how many layers, their bytes with
    # scales and zeros, and the same weights' bytes in the model's dtype.
    weights: str = ""
    weight_group: int = 0
    quantized_layers: int = 0
    quantized_bytes: int = 0
    float_bytes: int = 0
    # The head and token embedding held int8 (a tied pair once): their bytes with
    # scales, and in the model's dtype; 0 where they are the model's (files before it).
    head_bytes: int = 0
    head_float_bytes: int = 0

    def start_of(self, start: Any, rows: int, length: int) -> Any:
        """The step's ``start`` for ``rows`` rows of ``length`` new tokens written from
        cache index ``start`` (a 0-d tensor): once a row for a one-token step where the
        file decodes by its slot step (``decode_by_slots``), else ``start`` itself."""
        return start.repeat(rows) if self.decode_by_slots and length == 1 else start

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kind": "decoder-generator", "version": 1}

    @classmethod
    def from_json(cls, data: Any, where: str) -> GeneratorSpec:
        try:
            if data.get("kind") != "decoder-generator" or data.get("version") != 1:
                raise ValueError("not a version-1 decoder generator record")
            return cls(
                max_batch=int(data["max_batch"]),
                max_length=int(data["max_length"]),
                kv_shapes=tuple((int(h), int(d)) for h, d in data["kv_shapes"]),
                dtype=str(data["dtype"]),
                device=str(data["device"]),
                eos_token_id=tuple(int(t) for t in data["eos_token_id"]),
                pad_token_id=None if data["pad_token_id"] is None else int(data["pad_token_id"]),
                model_type=str(data.get("model_type", "")),
                slots=bool(data.get("slots", False)),
                decode_by_slots=bool(data.get("decode_by_slots", False)),
                chat_template=_optional_str(data.get("chat_template")),
                chat_tokens=tuple((str(k), str(v)) for k, v in data.get("chat_tokens", ())),
                sampling=sampling_settings(dict(data.get("sampling", ()))),
                lengths=length_settings(dict(data.get("lengths", ()))),
                weights=_weights(data.get("weights", "")),
                weight_group=int(data.get("weight_group", 0)),
                quantized_layers=int(data.get("quantized_layers", 0)),
                quantized_bytes=int(data.get("quantized_bytes", 0)),
                float_bytes=int(data.get("float_bytes", 0)),
                head_bytes=int(data.get("head_bytes", 0)),
                head_float_bytes=int(data.get("head_float_bytes", 0)),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ArtifactCorruptedError(
                f"{where}: the '{GENERATOR}' section is not a generator record ({exc}); "
                "build the generator again with compile_generator and Precompile.save"
            ) from None


def sampling_settings(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The keys of :data:`SAMPLING_DEFAULTS` that ``config`` sets (not None), typed."""
    return _recorded(config, SAMPLING_DEFAULTS, "sampling", _sampling_value)


def length_settings(config: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The keys of :data:`LENGTH_KEYS` that ``config`` sets (not None), as token counts."""
    return _recorded(config, LENGTH_KEYS, "length", _count)


def _recorded(
    config: dict[str, Any], keys: Any, kind: str, typed: Callable[[str, Any], Any]
) -> tuple[tuple[str, Any], ...]:
    """``config``'s settings among ``keys`` that are not None, ``typed``, sorted; a
    ``ValueError`` for any other key."""
    found = []
    for key, value in config.items():
        if key not in keys:
            raise ValueError(f"'{key}' is not a {kind} setting")
        if value is not None:
            found.append((key, typed(key, value)))
    return tuple(sorted(found))


def _sampling_value(key: str, value: Any) -> Any:
    if key == "do_sample":
        if not isinstance(value, bool):
            raise ValueError(f"do_sample must be true or false, got {value!r}")
        return value
    return int(value) if key == "top_k" else float(value)


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a number of tokens, got {value!r}")
    return value


def _weights(value: Any) -> str:
    if value not in ("", "int8", "int4"):
        raise ValueError(f"weights {value!r} is not a format this version serves")
    return value


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value
