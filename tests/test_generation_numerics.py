"""Numerics as the field measures them, on a model whose logits are not flat.

A tiny Llama (2 layers, width 64, byte vocabulary) is trained here for 300
steps on a Python source file of the standard library (``textwrap.py``), so
its next-token distribution is peaked as a real model's is (random weights
give near-ties everywhere, where any check passes or fails by chance). The
generator built from it is compared with transformers' ``generate`` as vLLM's
``check_logprobs_close`` does (at the first differing token, each side's
token in the other's top-5), its step's logits with eager's, and the check is
shown to refuse a model that is not the same.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.fixtures.hf_models import assert_step_close  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402
from torch_precompile.generation.numerics import (  # noqa: E402
    Divergence,
    check_logprobs_close,
    generator_topk,
    topk_of_scores,
)

MAX_LENGTH, PROMPT, NEW = 64, 24, 32
CONFIG = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
CONFIG |= dict(num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
CONFIG |= dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)


def _text() -> torch.Tensor:
    with open(textwrap.__file__, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = _text()
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        starts = torch.randint(0, len(data) - 65, (16,), generator=g)
        batch = torch.stack([data[s : s + 65] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    path = tmp_path_factory.mktemp("numerics") / "gen.pt"
    # One row (two programs): every check here runs one prompt.
    Precompile.save(path, compile_generator(model, max_batch=1, max_length=MAX_LENGTH))
    prompt = data[1000 : 1000 + PROMPT].reshape(1, -1)
    return {"model": model, "loss": float(loss), "gen": Precompile.load(path), "prompt": prompt}


def _eager(model: Any, prompt: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, PROMPT:].tolist(), topk_of_scores(out.logits)


def test_the_model_is_trained_its_logits_are_peaked(trained: dict[str, Any]) -> None:
    assert trained["loss"] < 2.6, trained["loss"]  # ln(256) = 5.5 untrained
    with torch.no_grad():
        probs = trained["model"](trained["prompt"]).logits[0].softmax(-1)
    assert float(probs.max(-1).values.median()) > 0.3  # not the near-ties of random weights


def test_generator_is_close_to_eager_as_vllm_checks(trained: dict[str, Any]) -> None:
    gen, prompt = trained["gen"], trained["prompt"]
    tokens, topk = _eager(trained["model"], prompt)
    got = gen.generate(prompt, max_new_tokens=NEW, eos_token_id=None)[0, PROMPT:].tolist()
    got_topk = generator_topk(gen, prompt[0], got)
    assert [t[0] for t in got_topk] == got  # the teacher-forced programs give its own argmax
    # fp32 on CPU: equal tokens, so no divergence at all
    assert check_logprobs_close(tokens, topk, got, got_topk, name_1="generator") is None
    assert got == tokens


def test_generator_step_logits_match_eager(trained: dict[str, Any]) -> None:
    """Logits, not only argmax: a dropped scale would keep greedy tokens, not these."""
    gen, prompt, model = trained["gen"], trained["prompt"], trained["model"]
    spec = gen.spec
    cache = [t[:1] for t in gen.cache()]
    full = torch.zeros((1, spec.max_length), dtype=torch.long)
    full[:, :PROMPT] = 1
    positions = torch.arange(PROMPT).reshape(1, -1)
    with torch.no_grad():
        got = gen(prompt, full, positions, torch.tensor(0), *cache)[:, -1]
        want = model(prompt).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_check_refuses_another_model(trained: dict[str, Any]) -> None:
    tokens, topk = _eager(trained["model"], trained["prompt"])
    other, other_topk = _eager(_model(1), trained["prompt"])
    with pytest.raises(AssertionError, match="first differ at new token 0"):
        check_logprobs_close(tokens, topk, other, other_topk, name_1="untrained")


def test_a_near_tie_passes_and_names_where() -> None:
    found = check_logprobs_close(
        [5, 6, 7], [[5], [6, 9], [7]], [5, 9, 1], [[5], [9, 6], [1]], name_1="bf16"
    )
    assert found == Divergence(1, 6, 9, True, True) and found.close
    with pytest.raises(AssertionError, match=r"bf16 chose 9 \(not in reference's top-k"):
        check_logprobs_close([5, 6], [[5], [6, 1]], [5, 9], [[5], [9, 6]], name_1="bf16")


def test_step_close_bounds_rounding_at_the_rows_scale_and_refuses_real_differences() -> None:
    """The fp32 comparison of a generation step (``assert_step_close``): rounding at the
    row's scale passes (1.5e-4 at a small logit of a row whose largest is 19, as a CPU with
    AVX-512 gave); a logit scale of 1.001 or 1/16, swapped rows, one logit off by 1e-3
    and a processor's ``-inf`` at another place are refused."""
    torch.manual_seed(0)
    e = torch.randn(3, 1000) * 6
    e[0, 0], e[0, 1] = 19.0, 4.5
    rounded = e.clone()
    rounded[0, 1] += 1.5e-4
    assert_step_close(e, rounded, "rounding")
    one_off = e.clone()
    one_off[1, 5] += 1e-3
    masked = e.clone()
    masked[2, 3] = -float("inf")
    masked_elsewhere = masked.clone()
    masked_elsewhere[2, 3], masked_elsewhere[2, 4] = e[2, 3], -float("inf")
    assert_step_close(masked, masked.clone(), "the same -inf")
    for label, eager, ours in [
        ("scale 1.001", e, e * 1.001),
        ("scale 1/16", e, e / 16),
        ("rows swapped", e, e[[1, 0, 2]]),
        ("one logit", e, one_off),
        ("-inf elsewhere", masked, masked_elsewhere),
    ]:
        with pytest.raises(AssertionError, match=label):
            assert_step_close(eager, ours, label)
