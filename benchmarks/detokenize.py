"""The server's text per token: a whole decode of the run so far (the engine before
2026-11-27) against the incremental detokenizer (``serve/detokenizer.py``).

A byte-level BPE of 16,000 tokens is trained here on torch's own ``_dynamo`` sources
(no download), and a run's tokens are a slice of those sources. For each run length,
the time to turn every new token into the text to send, summed over the run, divided
by its tokens: what one slot adds to each decode step on this machine's CPU.

    PYTHONPATH=. python benchmarks/detokenize.py [--lengths 128,512,2048]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path

import torch
from harness import write_result
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torch_precompile.serve.detokenizer import IncrementalText


def tokenizer_and_ids() -> tuple[Tokenizer, list[int]]:
    root = os.path.dirname(torch.__file__)
    texts = [Path(f).read_text() for f in sorted(glob.glob(f"{root}/_dynamo/*.py"))[:60]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16000, initial_alphabet=alphabet))
    return tok, tok.encode("\n".join(texts)).ids


def whole(tok: Tokenizer, ids: list[int]) -> float:
    """Seconds per token of decoding the whole run at each token (the old engine's way)."""
    start = time.perf_counter()
    for n in range(1, len(ids) + 1):
        tok.decode(ids[:n], skip_special_tokens=True)
    return (time.perf_counter() - start) / len(ids)


def incremental(tok: Tokenizer, ids: list[int]) -> float:
    start = time.perf_counter()
    text = IncrementalText(tok, ("</s>",))
    for i, token in enumerate(ids):
        text.add(token)
        text.take(final=i == len(ids) - 1)
    return (time.perf_counter() - start) / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--out", default=None, help="write the result (JSON) here")
    args = parser.parse_args()
    tok, ids = tokenizer_and_ids()
    rows = []
    for n in map(int, args.lengths.split(",")):
        run = ids[:n]
        best = {
            name: min(f(tok, run) for _ in range(3))
            for name, f in (("whole", whole), ("incremental", incremental))
        }
        rows.append({"tokens": n, **{k: v * 1e6 for k, v in best.items()}})
        print(
            f"{n:>6} tokens: whole decode {best['whole'] * 1e6:8.1f} us/token, "
            f"incremental {best['incremental'] * 1e6:6.1f} us/token"
        )
    print(json.dumps({"torch": torch.__version__, "us_per_token": rows}))
    if args.out:
        write_result(args.out, {"us_per_token": rows})


if __name__ == "__main__":
    main()
