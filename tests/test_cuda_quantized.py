"""Quantized generator files on CUDA (bf16; runs on a GPU machine, skipped elsewhere).

The trained Llama of tests/fixtures/trained_lm.py in bf16, built int8 and int4:
each file's greedy walk against eager transformers over the weights it holds
(dequantized in plain torch) and against the bf16 file, vLLM's way (at the
first differing token each side's token is in the other's top 5)::

    python -m pytest tests/test_cuda_quantized.py -v -rs -s
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")
FORMATS = ("int8", "int4")

from tests.fixtures.quantized_checks import NEW, PROMPT, dequantized, eager, served, walk  # noqa: E402
from tests.fixtures.trained_lm import train, training_text  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402


@pytest.fixture(scope="module")
def cuda_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cuda_quantized")
    model, tok = train()
    model = model.to("cuda", torch.bfloat16).eval()
    stream = torch.tensor(tok(training_text())["input_ids"])
    step = (len(stream) - PROMPT) // 16
    prompts = torch.stack([stream[i * step : i * step + PROMPT] for i in range(16)]).cuda()
    out: dict[str, Any] = {"model": model, "prompts": prompts}
    for weights in (None, *FORMATS):
        gen = compile_generator(model, max_batch=1, max_length=PROMPT + NEW, weights=weights)
        Precompile.save(root / f"{weights or 'bf16'}.pt", gen)
        out[weights or "bf16"] = root / f"{weights or 'bf16'}.pt"
    return out


def _walks(a: Any, b: Any) -> list[tuple[int, list[float], bool]]:
    (tokens, logits), (ref, ref_logits) = a, b
    return [walk(tokens[r], logits[r].float(), ref[r], ref_logits[r].float()) for r in range(16)]


@pytest.mark.parametrize("weights", FORMATS)
def test_a_cuda_quantized_file_computes_what_its_weights_say(
    cuda_files: dict[str, Any], weights: str
) -> None:
    """Against eager over the dequantized weights (bf16): a wrong packing or scale gives
    other tokens from the first step; bf16's rounding may flip a late one."""
    prompts = cuda_files["prompts"]
    out = eager(dequantized(cuda_files["model"], weights).to(torch.bfloat16), prompts)
    ref = (out.sequences[:, PROMPT:], list(torch.stack(out.logits, 1)))
    walks = _walks(served(cuda_files[weights], prompts), ref)
    assert all(ok for _, _, ok in walks), [(n, ok) for n, _, ok in walks]
    assert sum(n == NEW for n, _, _ in walks) >= 12, [n for n, _, _ in walks]


def test_cuda_quantized_files_stay_close_to_the_bf16_file(cuda_files: dict[str, Any]) -> None:
    prompts = cuda_files["prompts"]
    bf16 = served(cuda_files["bf16"], prompts)
    means = {}
    for weights in FORMATS:
        walks = _walks(served(cuda_files[weights], prompts), bf16)
        assert all(ok for _, _, ok in walks), (weights, [(n, ok) for n, _, ok in walks])
        diffs = [d for _, ds, _ in walks for d in ds]
        means[weights] = sum(diffs) / len(diffs)
        agreed = [n for n, _, _ in walks]
        print(f"\n{weights} vs bf16 (CUDA): mean |logprob diff| {means[weights]:.4f}; {agreed}")
    assert means["int8"] < means["int4"]
