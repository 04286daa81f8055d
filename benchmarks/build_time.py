"""Build time: where ``compile_generator``'s time goes, program by program.

Each build runs in a fresh process with empty compiler caches (as a user's first
build, or CI's). The child times every program the build compiles (the span from
its "compiling the step" line to the next) and, inside each, Dynamo, AOTAutograd,
Inductor and the precompile stage from their own "done in" lines; then the whole
build and the saved file's size; with ``--forward``, one forward compile of the
same model (``Precompile.compile`` on a prompt) in a fresh process of its own,
for scale. Usage::

    python benchmarks/build_time.py --model smollm2 --device cpu --max-batch 1,4
    python benchmarks/build_time.py --model qwen05 --device cuda --max-batch 1,8

Models: ``tiny`` (the tests' 2-layer Llama), ``smollm2`` (SmolLM2-135M's shape),
``qwen05`` and ``llama3b`` (benchmarks/generation.py's shapes), random init.
"""

from __future__ import annotations

import argparse
import json
import sys

from harness import REPO, empty_caches, run_child, write_result

CHILD = r"""
import json, logging, os, re, sys, tempfile, time
import torch, transformers
from torch_precompile import Precompile
from torch_precompile.generation import compile_generator

name, device, max_batch, max_length, forward = sys.argv[1:6]
max_batch, max_length, forward = int(max_batch), int(max_length), forward == "1"
SHAPES = {
    "tiny": ("LlamaConfig", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)),
    "smollm2": ("LlamaConfig", dict(num_hidden_layers=30, hidden_size=576,
                intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                vocab_size=49152, tie_word_embeddings=True)),
    "qwen05": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864,
               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
               vocab_size=151936, tie_word_embeddings=True)),
    "llama3b": ("LlamaConfig", dict(hidden_size=3072, intermediate_size=8192,
                num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=True)),
}
kind, kw = SHAPES[name]
config = getattr(transformers, kind)(max_position_embeddings=4096, **kw)
torch.manual_seed(0)
dtype = torch.bfloat16 if device == "cuda" else torch.float32
with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()

if forward:  # one forward compile of the same model alone, for scale
    ids = torch.randint(0, 100, (1, 16), device=device)
    f0 = time.perf_counter()
    with torch.no_grad():
        Precompile.compile(model, (ids,), {"use_cache": False})
    print("RESULT", json.dumps({"forward_compile_s": round(time.perf_counter() - f0, 2)}))
    sys.exit(0)

t0 = time.perf_counter()
marks = []  # (time, message) of every INFO line of the build
class Marks(logging.Handler):
    def emit(self, record):
        marks.append((time.perf_counter() - t0, record.getMessage()))
log = logging.getLogger("torch_precompile")
log.setLevel(logging.INFO)
log.addHandler(Marks())
generator = compile_generator(model, max_batch=max_batch, max_length=max_length)
build = time.perf_counter() - t0
path = os.path.join(tempfile.mkdtemp(), "g.pt")
s0 = time.perf_counter()
Precompile.save(path, generator)
save = time.perf_counter() - s0

programs, current = [], None
for at, message in marks:
    # "compiling prefill, batch 2..8 (1 of 5), 3 s elapsed"; before: "the step at batch 5, ..."
    found = re.match(r"generator: compiling (.+?) \(\d+ of \d+\)|generator: compiling (.+)",
                     message)
    if found:
        label = found[1] or found[2]
        current = {"program": label, "start": at, "stages": {}}
        programs.append(current)
        continue
    done = re.match(r"(dynamo|aot_autograd|inductor|precompile): done in ([\d.]+) s", message)
    if done and current is not None:
        current["stages"][done[1]] = current["stages"].get(done[1], 0.0) + float(done[2])
for i, p in enumerate(programs):
    end = programs[i + 1]["start"] if i + 1 < len(programs) else build
    p["seconds"] = round(end - p.pop("start"), 2)
    p["stages"] = {k: round(v, 2) for k, v in p["stages"].items()}
result = {
    "model": name, "device": device, "max_batch": max_batch, "max_length": max_length,
    "build_s": round(build, 2), "save_s": round(save, 2), "programs": programs,
    "file_mb": round(os.path.getsize(path) / 2**20, 1),
}
print("RESULT", json.dumps(result))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2", "qwen05", "llama3b"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", default="1,4", help="comma-separated, one build each")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--forward", action="store_true", help="also time one forward compile")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per build")
    p.add_argument("--out", default=None, help="results file (default: benchmarks/results/)")
    a = p.parse_args()
    rows: list[dict] = []
    extra: dict[str, float] = {}
    runs = [(int(b), "0") for b in a.max_batch.split(",")] + ([(1, "1")] if a.forward else [])
    for batch, forward in runs:  # each in a fresh process with empty caches
        args = [a.model, a.device, str(batch), str(a.max_length), forward]
        with empty_caches() as env:
            out = run_child(CHILD, *args, env=env, timeout=a.timeout)
        row = json.loads(out.split("RESULT", 1)[1])
        if forward == "1":
            extra.update(row)
        else:
            rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    default = REPO / "benchmarks" / "results" / f"build_time_{a.model}_{a.device}.json"
    write_result(a.out or default, {"builds": rows, **extra})
    return 0


if __name__ == "__main__":
    sys.exit(main())
