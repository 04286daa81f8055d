"""Generation on an artifact across a sliding window: Mistral (every layer windowed)
and Gemma2 (windowed and full layers alternating), window 8, prompts from 1 token to
past the window, decoding to five times the window; each row's tokens and each step's
scores equal eager ``generate``'s, from a file loaded in the test process without the
live model's weights (standalone). Gemma2's rows are left-padded batches of 3; Mistral's
file holds its batch-1 programs only (CI time: half the build), so each of its rows
is a call of its own."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.generation_files import SINGLE_BATCH, generation_file
from tests.fixtures.hf_models import assert_same_generation, generate_both, tiny_decoder
from tests.fixtures.store import Store
from torch_precompile import Precompile

T = pytest.importorskip("transformers")

VOCAB = 1000
WINDOW = 8


@pytest.fixture(scope="module", params=["mistral", "gemma2"])
def built(request: pytest.FixtureRequest, store: Store):
    model = tiny_decoder(request.param)
    assert model.config.sliding_window == WINDOW
    return request.param, model, Precompile.load(generation_file(store, request.param))


@pytest.mark.parametrize("prompt", [1, 3, WINDOW - 2, WINDOW - 1, WINDOW, WINDOW + 1, 20])
def test_rows_equal_eager_across_the_window(built, prompt: int) -> None:
    kind, model, loaded = built
    x = torch.randint(0, VOCAB, (3, prompt), generator=torch.Generator().manual_seed(prompt))
    mask = torch.ones_like(x)
    mask[1, : min(2, prompt - 1)] = 0  # rows padded on the left (when the prompt allows)
    mask[2, : prompt // 2] = 0
    new = 5 * WINDOW - prompt
    calls = (
        [(x[r : r + 1], mask[r : r + 1]) for r in range(3)] if kind in SINGLE_BATCH else [(x, mask)]
    )
    for ids, rows in calls:
        kw = dict(attention_mask=rows, pad_token_id=0, max_new_tokens=new, min_new_tokens=new)
        assert_same_generation(*generate_both(model, loaded, ids, **kw), f"{kind} prompt {prompt}")


def test_batch_one_across_the_window(built) -> None:
    from torch_precompile.generation import generate_with

    kind, model, loaded = built
    x = torch.randint(0, VOCAB, (1, WINDOW - 3), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=3 * WINDOW, min_new_tokens=3 * WINDOW, do_sample=False)
    with torch.no_grad():
        eager = model.generate(x, **kw)
        with generate_with(model, loaded):
            ours = model.generate(x, **kw)
    assert torch.equal(eager, ours), kind
