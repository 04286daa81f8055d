"""A generator's tokens on CUDA against eager ``generate``: with and without CUDA graphs.

Tiny Llama (random init), fp32 and bf16, a left-padded batch of 3, 16 new tokens,
greedy, twice per artifact (the second call reuses the recorded CUDA graphs).
Prints, for each dtype and ``mode``, how many new tokens of each row equal
eager's. Found, and then checked, the fix of a generator whose KV cache was not
marked static: under ``mode="reduce-overhead"`` each step wrote the cache into the
CUDA graph's own copy, and rows diverged from eager after 4 to 9 tokens.

Usage (repository root, on a GPU machine):
``PYTHONPATH=. python benchmarks/generator_cuda_check.py``
"""

from __future__ import annotations

import tempfile
import time

import torch
import transformers

from torch_precompile import Precompile
from torch_precompile.generation import compile_generator

NEW, PROMPT = 16, 9


def matching(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """New tokens of each row equal to eager's, before the first that differs."""
    out = []
    for a, b in zip(got.tolist(), want.tolist()):
        n = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a))
        out.append(n - PROMPT)
    return out


def main() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    path = tempfile.mkdtemp() + "/generator.pt"
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.LlamaForCausalLM(config).to("cuda", dtype).eval()
        ids = torch.randint(1, 512, (3, PROMPT), device="cuda")
        mask = torch.ones_like(ids)
        ids[1, :3], mask[1, :3] = 0, 0
        kw = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW)
        with torch.no_grad():
            eager = model.generate(ids, do_sample=False, **kw)
        for mode in (None, "reduce-overhead"):
            start = time.time()
            Precompile.save(path, compile_generator(model, max_batch=4, max_length=32, mode=mode))
            gen = Precompile.load(path)
            runs = [
                matching(gen.generate(ids, pad_token_id=0, do_sample=False, **kw), eager)
                for _ in range(2)
            ]
            print(f"{dtype} mode={mode}: rows equal eager for {runs} of {NEW} new tokens "
                  f"({time.time() - start:.1f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
