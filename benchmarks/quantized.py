"""Quantized generator files against the fp32 file of the same model, fresh processes.

The model: a Llama of the SmolLM2-135M shape (hidden 576, 30 layers, 9 heads, 3
KV heads, MLP 1536, vocab 49152, tied embeddings), random weights from a seed,
fp32. It is built three times with ``compile_generator`` (``weights`` None,
"int8", "int4"), each build its own process. Then, for each file and batch
size, one fresh process at a time (``torchao`` and ``transformers`` not
importable in it, checked) reports:

- ``file_mb``: the file's size;
- ``load_s``: ``Precompile.load(path)``;
- ``first_token_s``: from the parent's spawn to the end of a one-token
  ``generate`` (import, load, the prefill of a 16-token prompt);
- ``decode_tok_s``: new tokens a row per second of decode, from two timed
  ``generate`` calls after one untimed warm-up: ``(N - 1) / (t(N) - t(1))``,
  the prefill cancelled out;
- ``agree``: how many of the greedy tokens of row 0 equal the fp32 file's.

Usage (repository root; a build of the full shape takes many minutes on 2 cores)::

    PYTHONPATH=. python benchmarks/quantized.py --workdir /tmp/quantized --batches 1,8
    PYTHONPATH=. python benchmarks/quantized.py --layers 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # the machine's description

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
FORMATS = ("fp32", "int8", "int4")

_BUILD = """
import json, sys, time, torch, transformers
from torch_precompile import Precompile
from torch_precompile.generation import compile_generator
shape, weights, path, max_batch, max_length = json.loads(sys.argv[1])
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
start = time.monotonic()
gen = compile_generator(model, max_batch=max_batch, max_length=max_length,
                        weights=None if weights == "fp32" else weights)
Precompile.save(path, gen)
print(json.dumps({"build_s": time.monotonic() - start}))
"""

_RUN = """
import sys
for name in ("torchao", "transformers"):
    sys.modules[name] = None
import json, time
spawned, path, batch, new = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import torch
from torch_precompile import Precompile
start = time.time()
gen = Precompile.load(path)
load_s = time.time() - start
ids = torch.randint(3, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
gen.generate(ids, max_new_tokens=1, eos_token_id=None)
first_token_s = time.time() - spawned
tokens = gen.generate(ids, max_new_tokens=new, eos_token_id=None)  # warm-up
def timed(n):
    start = time.perf_counter()
    gen.generate(ids, max_new_tokens=n, eos_token_id=None)
    return time.perf_counter() - start
one, full = min(timed(1) for _ in range(3)), min(timed(new) for _ in range(2))
print(json.dumps({
    "load_s": load_s, "first_token_s": first_token_s,
    "decode_tok_s": (new - 1) / (full - one), "tokens": tokens[0, 16:].tolist(),
    "threads": torch.get_num_threads(),
    "imported": [m for m in ("torchao", "transformers", "torch._dynamo") if sys.modules.get(m)],
}))
"""


def _child(source: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run(
        [sys.executable, "-c", source, *args], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/quantized-bench")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--out", default="")
    parser.add_argument("--reuse", action="store_true", help="keep files already built")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    shape = {**SHAPE, "num_hidden_layers": args.layers}
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": harness.machine(), "shape": shape, "files": {}}
    results["load_avg_before"] = os.getloadavg()
    for name in FORMATS:
        path = work / f"{name}-{args.layers}.pt"
        record: dict = {}
        if not (args.reuse and path.exists()):
            spec = [shape, name, str(path), max(batches), args.max_length]
            record |= _child(_BUILD, json.dumps(spec))
            print(f"{name}: built in {record['build_s']:.0f} s", file=sys.stderr)
        record["file_mb"] = path.stat().st_size / 2**20
        for batch in batches:
            ran = _child(_RUN, repr(time.time()), str(path), str(batch), str(args.new_tokens))
            assert ran["imported"] == [], ran["imported"]
            record[f"batch{batch}"] = ran
            print(f"{name} batch {batch}: {ran['decode_tok_s']:.1f} tok/s", file=sys.stderr)
        results["files"][name] = record
    reference = results["files"]["fp32"]
    for record in results["files"].values():
        for batch in batches:
            mine, theirs = record[f"batch{batch}"]["tokens"], reference[f"batch{batch}"]["tokens"]
            agree = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
            record[f"batch{batch}"]["agree"] = agree
    results["load_avg_after"] = os.getloadavg()
    print(_table(results, batches))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def _table(results: dict, batches: list[int]) -> str:
    ref = results["files"]["fp32"]
    head = "| file | MB | load s | first token s |"
    head += "".join(f" decode tok/s b{b} (x fp32) |" for b in batches)
    lines = [head, "|" + "---|" * (4 + len(batches))]
    for name, r in results["files"].items():
        row = f"| {name} | {r['file_mb']:.1f} ({r['file_mb'] / ref['file_mb']:.2f}x) |"
        row += f" {r['batch1' if 1 in batches else f'batch{batches[0]}']['load_s']:.2f} |"
        row += f" {r[f'batch{batches[0]}']['first_token_s']:.2f} |"
        for b in batches:
            tps, base = r[f"batch{b}"]["decode_tok_s"], ref[f"batch{b}"]["decode_tok_s"]
            row += f" {tps:.1f} ({tps / base:.2f}x) |"
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
