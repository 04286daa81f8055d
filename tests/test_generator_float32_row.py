"""A float32 CPU file past the caches: its one-row slot step (decode_matmul.py).

A 2-layer Llama of width 64 whose token embedding and untied head (131,072 tokens)
hold 64 MiB, the size from which a float32 CPU build compiles a slot step of one
static row beside the one of 1..N rows: there the row's matmuls, the head's too, are
Inductor's reductions rather than ``mm`` (in the step of 1..N rows, oneDNN's linear).
``generate`` of one row decodes by it, of two rows by the other; both equal
transformers' tokens and every step's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_generator import _hf  # noqa: E402

from tests.fixtures.hf_models import assert_same_logits  # noqa: E402
from tests.fixtures.store import Store  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402
from torch_precompile.generation.decode_matmul import FLOAT32_ONE_ROW_BYTES  # noqa: E402

MAX_LENGTH, VOCAB = 32, 131072
_LOGITS = dict(return_dict_in_generate=True, output_logits=True)


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def built(store: Store) -> dict[str, Any]:
    def build(path: Path) -> None:
        Precompile.save(path, compile_generator(_model(), max_batch=3, max_length=MAX_LENGTH))

    key = {"model": "llama-float32-row", "vocab": VOCAB, "max_length": MAX_LENGTH}
    path = store.saved("llama-float32-row", key, build)
    return {"model": _model(), "loaded": Precompile.load(path)}


def test_three_programs_a_one_row_slot_step_among_them(built: dict[str, Any]) -> None:
    model = built["model"]
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held >= FLOAT32_ONE_ROW_BYTES
    loaded = built["loaded"]
    assert len(loaded.step.variants) == 3  # prefill, slot step of one row, of 1..3 rows
    assert loaded.spec.decode_by_slots


@pytest.mark.parametrize(("rows", "length", "new"), [(1, 5, 8), (1, MAX_LENGTH - 6, 6), (2, 7, 6)])
def test_greedy_and_logits_equal_transformers(
    built: dict[str, Any], rows: int, length: int, new: int
) -> None:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    want = _hf(built["model"], ids, mask, new, eos_token_id=None, **_LOGITS)
    got = built["loaded"].generate(ids, mask, max_new_tokens=new, eos_token_id=None, **_LOGITS)
    # The prefill, and two rows' decode steps, multiply by oneDNN's linear
    # (lean/linear_rows.py): float32 all through, summed in another order than MKL's,
    # off float64's product by up to 3x what MKL's mm is (8.8e-6 against 3.8e-6 for a
    # 64-wide row of weights N(0, 0.5)); this model's logits reach 17.
    assert_same_logits(want, got, f"{rows} rows, length {length}", 3e-4)
