"""What each new prompt length costs a generator on a GPU: time, and memory kept.

Builds a Llama-3.2-3B-shaped generator (random weights, bf16, ``--layers`` decoder
layers, ``mode="reduce-overhead"``), then in a fresh process loads it and, for each
prompt length of ``--lengths``, runs a one-token ``generate`` (the prefill alone)
three times: the first call of a length (the libraries' set-up for its shapes:
cuBLAS for the new row count, the attention's plan for the new length), the
second (where a recorded step records its CUDA graph), the third (a replay, or a
plain run). After each length it reads ``torch.cuda.memory_reserved()``: a
recording keeps its own memory pool, so one a length grows with the lengths seen.

Usage (a CUDA machine)::

    PYTHONPATH=. python benchmarks/prefill_lengths.py --layers 4 --out prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from generation import SIZES


def build(path: str, layers: int, max_length: int) -> dict:
    import torch
    import transformers

    from torch_precompile import Precompile
    from torch_precompile.generation import compile_generator

    kind, fields = SIZES["llama3b"]  # generation.py's Llama-3.2-3B shape
    config = getattr(transformers, kind)(**{**fields, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    began = time.perf_counter()
    generator = compile_generator(model, max_batch=1, max_length=max_length, mode="reduce-overhead")
    compile_s = time.perf_counter() - began
    Precompile.save(path, generator)
    return {"compile_s": round(compile_s, 1), "bytes": os.path.getsize(path)}


def measure(path: str, lengths: list[int]) -> dict:
    import torch

    from torch_precompile import Precompile
    from torch_precompile.lean import cudagraphs

    torch.zeros(1, device="cuda")
    gen = Precompile.load(path)
    torch.cuda.synchronize()

    def prefill_ms(n: int) -> float:
        ids = torch.randint(0, 128000, (1, n), device="cuda")
        torch.cuda.synchronize()
        began = time.perf_counter()
        gen.generate(ids, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        return round((time.perf_counter() - began) * 1000, 1)

    mib = 1 << 20
    base = torch.cuda.memory_reserved() / mib
    rows = []
    for n in lengths:
        first, second, third = prefill_ms(n), prefill_ms(n), prefill_ms(n)
        grown = round(torch.cuda.memory_reserved() / mib - base)
        rows.append({"length": n, "ms": [first, second, third], "reserved_growth_mib": grown})
    recorded = cudagraphs.STATS["recorded"]
    return {"recorded": recorded, "base_reserved_mib": round(base), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-length", type=int, default=1100)
    p.add_argument("--lengths", default="16:1041:32", help="start:stop:step, as range()")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, choices=("build", "measure"), help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    lengths = list(range(*(int(x) for x in a.lengths.split(":"))))
    if a.child == "build":
        print(json.dumps(build(a.path, a.layers, a.max_length)))
        return
    if a.child == "measure":
        print(json.dumps(measure(a.path, lengths)))
        return
    path = os.path.join(tempfile.mkdtemp(prefix="prefill-"), "generator.pt")
    result: dict = {"layers": a.layers, "max_length": a.max_length}
    for role in ("build", "measure"):  # each in a fresh process
        argv = [sys.executable, __file__, *sys.argv[1:], "--child", role, "--path", path]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        result[role] = json.loads(done.stdout.strip().splitlines()[-1])
    import torch

    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
