"""Generation on an artifact agrees with eager beyond full-mask batches: left-padded
rows (``generate`` passes ``position_ids`` built from the mask only when it sees the
model's forward signature), calls without ``attention_mask``, a cache of another
class than the artifact's (refused, naming both), encoder-decoder models (refused at
build)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.generation_files import generation_file
from tests.fixtures.hf_models import assert_same_generation, generate_both, tiny_decoder
from tests.fixtures.store import Store
from torch_precompile import Precompile
from torch_precompile._errors import CaptureError, GuardError

T = pytest.importorskip("transformers")

VOCAB = 1000


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def built(request: pytest.FixtureRequest, store: Store):
    """The tiny decoder's generation file, built once per run (test_workloads' too)."""
    model = tiny_decoder(request.param)
    path = generation_file(store, request.param)
    return request.param, model, Precompile.load(path, model=model)


def test_left_padded_rows_equal_eager(built) -> None:
    kind, model, loaded = built
    x = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(x)
    mask[1, :2] = 0  # rows padded on the left by 0, 2 and 5 tokens
    mask[2, :5] = 0
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=12, min_new_tokens=12)
    assert_same_generation(*generate_both(model, loaded, x, **kw), kind)


def test_generate_without_attention_mask_equals_eager(built) -> None:
    kind, model, loaded = built
    for shape in ((1, 5), (2, 9)):
        x = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(5))
        kw = dict(max_new_tokens=12, min_new_tokens=12)
        assert_same_generation(*generate_both(model, loaded, x, **kw), f"{kind} {shape}")


def test_generate_keeps_the_forward_signature(built) -> None:
    import inspect

    from torch_precompile.generation import generate_with

    _, model, loaded = built
    own = inspect.signature(model.forward)
    with generate_with(model, loaded):
        assert inspect.signature(model.forward) == own
    assert "forward" not in model.__dict__


def test_the_prefill_alone_runs_outside_cuda_graphs(built, monkeypatch) -> None:
    """Every prompt length is another layout of the prefill, which reduce-overhead would
    record into a CUDA graph with its own memory (lean/cudagraphs.py): inside
    ``generate_with`` the prefill, and no decode step, runs in ``not_recorded``."""
    import contextlib

    from torch_precompile.generation import generate_with, hf

    _, model, loaded = built
    entered: list[int] = []
    calls = loaded.__call__

    @contextlib.contextmanager
    def spy():
        entered.append(len(seen))
        yield

    seen: list[int] = []
    monkeypatch.setattr(hf, "not_recorded", spy)
    monkeypatch.setattr(
        type(loaded),
        "__call__",
        lambda self, *a, **k: seen.append(k["input_ids"].shape[1]) or calls(*a, **k),
    )
    x = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), generate_with(model, loaded):
        model.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert seen == [6, 1, 1, 1] and entered == [0], (seen, entered)


def test_a_cache_of_another_class_is_refused_naming_both(built) -> None:
    from torch_precompile.generation import generate_with

    _, model, loaded = built
    x = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), generate_with(model, loaded), pytest.raises(GuardError) as info:
        model.generate(x, max_new_tokens=3, do_sample=False, cache_implementation="static")
    text = str(info.value)
    assert "built for a DynamicCache" in text and "StaticCache" in text, text
    assert "cache_implementation" in text, text


def test_an_encoder_decoder_model_is_refused_at_build() -> None:
    from torch_precompile.generation import compile_for_generation

    cfg = T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = T.T5ForConditionalGeneration(cfg).eval()
    x = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    with pytest.raises(CaptureError, match="encoder-decoder"):
        compile_for_generation(model, x)
