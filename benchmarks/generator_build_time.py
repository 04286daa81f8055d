"""Where ``compile_generator``'s time goes: each program's Dynamo capture, AOTAutograd
trace, Inductor compile (C++ included) and precompile, beside one compile of the same
model's forward.

The model has random weights and the shape given (``--shape tiny``: the tests' 2-layer
width-64 Qwen2; ``smollm2``: SmolLM2-135M's, 30 layers, hidden 576, 9 heads, 3 KV heads,
vocab 49152). Inductor's cache is a fresh directory unless ``--warm-cache DIR`` names
one, so the figures are a cold build's. Writes JSON::

    python benchmarks/generator_build_time.py --shape tiny --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_STAGE = re.compile(r"^(dynamo|aot_autograd|inductor|precompile): done in ([\d.]+) s")

SHAPES = {
    "tiny": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
    ),
    "smollm2": dict(
        num_hidden_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}


class _Stages(logging.Handler):
    """Each program's stage seconds, from the package's INFO records in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.programs: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", False)
        if progress:
            self.programs.append({"program": progress.program, "stages": {}})
            return
        match = _STAGE.match(record.getMessage())
        if match and self.programs:
            stages = self.programs[-1]["stages"]
            stages[match[1]] = stages.get(match[1], 0.0) + float(match[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--warm-cache", help="Inductor's cache directory to use (default: new)")
    parser.add_argument("--no-forward", action="store_true", help="skip the forward's compile")
    parser.add_argument(
        "--forward-only",
        action="store_true",
        help="the forward's compile alone (after a generator build in the same Inductor cache, "
        "kernels the two share are found there: run this in a cache of its own)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.warm_cache or tempfile.mkdtemp(prefix="ind-")
    import torch
    import transformers

    from torch_precompile import Precompile
    from torch_precompile.generation import compile_generator

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **SHAPES[args.shape], max_position_embeddings=max(128, args.max_length)
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    log = logging.getLogger("torch_precompile")
    log.setLevel(logging.INFO)
    stages = _Stages()
    log.addHandler(stages)
    result: dict[str, Any] = {
        "shape": args.shape,
        "config": SHAPES[args.shape],
        "max_batch": args.max_batch,
        "max_length": args.max_length,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "load_average_before": os.getloadavg(),
        "inductor_cache": "warm" if args.warm_cache else "cold (a new directory)",
    }
    if not args.forward_only:
        began = time.perf_counter()
        compile_generator(model, max_batch=args.max_batch, max_length=args.max_length)
        result["generator_s"] = time.perf_counter() - began
        result["programs"] = stages.programs
    log.removeHandler(stages)  # the forward's stage records are not a program's
    if not args.no_forward:
        ids = torch.randint(0, config.vocab_size, (2, 16))
        began = time.perf_counter()
        with torch.no_grad():
            Precompile.compile(model, (ids,), dynamic=True, size_one=False)
        result["forward_compile_s"] = time.perf_counter() - began
        if "generator_s" in result:  # warm for the kernels the generator compiled
            result["generator_over_warm_forward"] = (
                result["generator_s"] / result["forward_compile_s"]
            )
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
