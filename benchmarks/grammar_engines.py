"""The grammar engines a server may constrain output with: llguidance against xgrammar.

A byte-level BPE of 49,152 tokens (SmolLM's vocabulary size) is trained here on
torch's own sources (no download). For each engine: the tokenizer's preparation
(once per file), one JSON schema's compile (no cache), and a step's mask for 1 and
16 matchers walking random allowed tokens (each matcher its own seed), one after
another and through the engine's parallel call; the packed bits unpacked into bool
masks with torch; and the server's own constraint (``serve/structured.py``), whose
mask is llguidance's byte per token.

    PYTHONPATH=. python benchmarks/grammar_engines.py [--vocab 49152] [--steps 48] [--out FILE]

xgrammar needs transformers at import (``xgrammar/tokenizer_info.py``), which a
serving process may not import; it is measured here all the same.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import write_result
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "company", "other"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "kind", "score"],
    "additionalProperties": False,
}
SHIFT = torch.arange(32, dtype=torch.int32)


def trained(vocab: int) -> Tokenizer:
    root = os.path.dirname(torch.__file__)
    files = sorted(glob.glob(f"{root}/**/*.py", recursive=True))[:1500]
    texts = [Path(f).read_text(errors="replace") for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=alphabet, special_tokens=special
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 words (32 tokens each) as a bool mask of ``vocab``."""
    return ((bits[..., None] >> SHIFT) & 1).bool().flatten(-2)[..., :vocab]


def walk(
    n: int,
    steps: int,
    fill: Callable[[torch.Tensor], None],
    accept: Callable[[int, int], None],
    vocab: int,
    words: int,
) -> list[float]:
    """Seconds per step of filling ``n`` masks; each row then takes a random allowed token."""
    bits = torch.zeros((n, words), dtype=torch.int32)
    rngs = [random.Random(i) for i in range(n)]
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        fill(bits)
        times.append(time.perf_counter() - began)
        allowed = unpack(bits, vocab)
        for row in range(n):
            ids = allowed[row].nonzero().flatten().tolist()
            if not ids:
                return times
            accept(row, rngs[row].choice(ids))
    return times


def figures_of(times: list[float]) -> dict[str, float]:
    """A walk's steps, and the median and 90th percentile of a step's masks in ms."""
    ordered = sorted(times)
    return {
        "steps": len(times),
        "median": 1e3 * statistics.median(ordered),
        "p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
    }


def llguidance_figures(tok: Tokenizer, eos: int, steps: int) -> dict[str, Any]:
    import llguidance

    began = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), eos_token=eos)
    prepared = time.perf_counter() - began
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    began = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), overrides=options)
    first = llguidance.LLMatcher(lltok, grammar)
    compiled = time.perf_counter() - began
    assert not first.is_error(), first.get_error()
    vocab, words = lltok.vocab_size, (lltok.vocab_size + 31) // 32
    out: dict[str, Any] = {"prepare_s": prepared, "compile_s": compiled}
    executor = llguidance.LLExecutor()
    for n in (1, 16):
        for parallel in (False, True):
            matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(n)]

            def fill(
                bits: torch.Tensor, matchers: list[Any] = matchers, par: bool = parallel
            ) -> None:
                if par:
                    pairs = [(m, i) for i, m in enumerate(matchers)]
                    executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), words * 4, len(pairs))
                    return
                for i, m in enumerate(matchers):
                    m.unsafe_compute_mask_ptr(bits[i].data_ptr(), words * 4)

            def accept(row: int, token: int, matchers: list[Any] = matchers) -> None:
                assert matchers[row].consume_token(token), matchers[row].get_error()

            times = walk(n, steps, fill, accept, vocab, words)
            out[f"mask_ms_{n}{'_parallel' if parallel else ''}"] = figures_of(times)
    return out


def served_figures(tok: Tokenizer, eos: int, steps: int) -> dict[str, Any]:
    """The server's own constraint (serve/structured.py): llguidance's byte-per-token
    mask read as a bool tensor, 16 requests one after another."""
    from torch_precompile.serve.structured import Grammars

    grammars = Grammars(tok.to_str(), [eos])
    began = time.perf_counter()
    constraints = [grammars.constraint("json", SCHEMA, "bench") for _ in range(16)]
    made = time.perf_counter() - began
    vocab = tok.get_vocab_size()
    rngs, times = [random.Random(i) for i in range(16)], []
    for _ in range(steps):
        began = time.perf_counter()
        masks = [c.allowed_mask(vocab) for c in constraints]
        times.append(time.perf_counter() - began)
        if any(c.done() for c in constraints):
            break
        for c, mask, rng in zip(constraints, masks, rngs):
            c.accept(rng.choice(mask.nonzero().flatten().tolist()))
    return {"sixteen_made_s": made, "mask_ms_16": figures_of(times)}


def xgrammar_figures(tok: Tokenizer, eos: int, steps: int) -> dict[str, Any]:
    import transformers
    import xgrammar as xgr

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    began = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=tok.get_vocab_size())
    prepared = time.perf_counter() - began
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    began = time.perf_counter()
    grammar = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")
    )
    compiled = time.perf_counter() - began
    vocab, words = info.vocab_size, (info.vocab_size + 31) // 32
    out: dict[str, Any] = {"prepare_s": prepared, "compile_s": compiled}
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    for n in (1, 16):
        for parallel in (False, True):
            matchers = [xgr.GrammarMatcher(grammar) for _ in range(n)]

            def fill(
                bits: torch.Tensor, matchers: list[Any] = matchers, par: bool = parallel
            ) -> None:
                if par:
                    batch.batch_fill_next_token_bitmask(matchers, bits)
                    return
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bits, i)

            def accept(row: int, token: int, matchers: list[Any] = matchers) -> None:
                assert matchers[row].accept_token(token)

            times = walk(n, steps, fill, accept, vocab, words)
            out[f"mask_ms_{n}{'_parallel' if parallel else ''}"] = figures_of(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    began = time.perf_counter()
    tok = trained(args.vocab)
    print(
        f"tokenizer: {tok.get_vocab_size()} tokens, trained in {time.perf_counter() - began:.1f} s"
    )
    eos = tok.token_to_id("<|endoftext|>")
    bits = torch.randint(
        -(2**31), 2**31 - 1, (16, (tok.get_vocab_size() + 31) // 32), dtype=torch.int32
    )
    began = time.perf_counter()
    for _ in range(20):
        unpack(bits, tok.get_vocab_size())
    unpack_ms = 1e3 * (time.perf_counter() - began) / 20
    results: dict[str, Any] = {"vocab": tok.get_vocab_size(), "unpack_ms_16": unpack_ms}
    engines = (("llguidance", llguidance_figures), ("xgrammar", xgrammar_figures))
    for name, figures in (*engines, ("served", served_figures)):
        results[name] = figures(tok, eos, args.steps)
        print(name, json.dumps(results[name], indent=1))
    print(f"bool mask from 16 rows of bits: {unpack_ms:.2f} ms")
    if args.out:
        write_result(args.out, results)


if __name__ == "__main__":
    main()
