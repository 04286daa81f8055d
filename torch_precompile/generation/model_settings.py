"""What a generator file takes from the model's ``generation_config`` and its tokenizer:
the sampling settings and lengths a request that leaves them out gets, the chat
template and its special tokens."""

from __future__ import annotations

import logging
from typing import Any

from ..runtime.generator_spec import (
    LENGTH_KEYS,
    SAMPLING_DEFAULTS,
    length_settings,
    sampling_settings,
)

log = logging.getLogger("torch_precompile")


# generation_config settings transformers' generate applies and a generator does not,
# each with the values that change nothing.
_NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None,),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "sequence_bias": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "renormalize_logits": (None, False),
}


def sampling_fields(model: Any) -> tuple[tuple[str, Any], ...]:
    """The sampling settings the model's generation_config sets (what transformers'
    ``generate`` and vLLM's server use when a call leaves them out); a setting of it
    that the generator does not apply is named in a warning."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return ()
    own = config.to_diff_dict()  # what differs from GenerationConfig's defaults
    ignored = {k: own[k] for k in _NOT_APPLIED if k in own and own[k] not in _NOT_APPLIED[k]}
    if ignored:
        log.warning(
            "generator: the model's generation_config sets %s, which Generator.generate and "
            "serve do not apply (transformers' generate does): their tokens can differ there",
            ", ".join(f"{k}={v!r}" for k, v in ignored.items()),
        )
    return sampling_settings({key: own[key] for key in SAMPLING_DEFAULTS if key in own})


def length_fields(model: Any) -> tuple[tuple[str, int], ...]:
    """How long the model's generation_config says a generation runs (``max_new_tokens``,
    ``max_length``) where it says so, as transformers' ``generate`` reads it."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return ()
    own = config.to_diff_dict()  # what differs from GenerationConfig's defaults
    return length_settings({key: own[key] for key in LENGTH_KEYS if key in own})


def chat_fields(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's chat template and the special tokens it names, for ``serve``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    if not isinstance(template, str):
        return {}
    tokens = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            tokens[name] = value
    return {"chat_template": template, "chat_tokens": tuple(sorted(tokens.items()))}
