"""Every decoder family the generator serves, against transformers' own ``generate``:
left-padded greedy decoding, each step's logits and scores (Cohere's and Granite's own
logit scaling included), from a saved and loaded generator. Its own file, beside
``test_generator.py``, so that the two build on two test processes at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_generator import SMALL, _build, _prompts, _same_as_transformers  # noqa: E402

from tests.fixtures.hf_models import generator_families  # noqa: E402

FAMILIES = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(num_key_value_heads=2, **SMALL)
    ),
    # A window shorter than the cache: later tokens attend to the last 12 only.
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(num_key_value_heads=2, sliding_window=12, **SMALL)
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(num_key_value_heads=2, **SMALL)
    ),
    "gemma": lambda: transformers.GemmaForCausalLM(
        transformers.GemmaConfig(num_key_value_heads=1, head_dim=16, **SMALL)
    ),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SMALL)),
    # Their own logit processing: Cohere multiplies by logit_scale, Granite divides by
    # logits_scaling (greedy tokens would not show a dropped one; logits do).
    "cohere": generator_families()["cohere"],
    "granite": generator_families()["granite"],
}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {"root": {"path": tmp_path_factory.mktemp("families")}}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_left_padded_greedy_equals_transformers(families: dict[str, Any], name: str) -> None:
    torch.manual_seed(0)
    case = _build(FAMILIES[name](), families["root"]["path"] / f"{name}.pt")
    ids, mask = _prompts(3, 10, seed=7)
    new = 20  # past the Mistral window of 12
    _same_as_transformers(case, ids, mask, new, eos_token_id=None)
    # The build's "guards not re-checked after load" warning, once for its four variants.
    assert sum("not re-checked after load" in m for m in case["warnings"]) == 1, case["warnings"]
