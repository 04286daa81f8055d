"""A decode token's linears on the CPU, several ways: what a generator file's step should call.

The 210 decoder linears of the SmolLM2-135M shape (30 layers; ``--layers`` of q, k, v, o, gate,
up, down; random weights), one row each, in one of these ways (``--ways``), each
in a fresh process (``--threads`` threads), best and median of ``--reps`` tokens:

- ``fp32``: ``F.linear`` over float32 weights (ATen, MKL);
- ``int8_aten_fp32`` / ``int8_aten_bf16``: ``aten._weight_int8pack_mm`` on float32
  activations / on activations cast to bfloat16 (the output cast back);
- ``int8_reduction``: Inductor's kernel of ``sum(x * q) * scale`` (``torch.compile``
  of all 210 at once), what ``decode_matmul.int8_one_row`` makes of the int8 one;
- ``int4_aten_bf16``: ``aten._weight_int4pack_mm_for_cpu`` on bfloat16 activations
  (groups of 64);
- ``int4_reduction``: Inductor's kernel over int4 nibbles unpacked in the sum.

Usage: ``python benchmarks/cpu_linears.py --threads 1 --ways fp32,int8_reduction``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
GROUP = 64
WAYS = ("fp32", "int8_aten_fp32", "int8_aten_bf16", "int8_reduction", "int4_aten_bf16")
WAYS += ("int4_reduction",)


def _int8(weights: list[torch.Tensor], way: str) -> tuple[Any, int]:
    qs = [torch.randint(-127, 127, w.shape, dtype=torch.int8) for w in weights]
    scales = [torch.rand(w.shape[0]) for w in weights]
    mm = torch.ops.aten._weight_int8pack_mm
    if way == "int8_aten_fp32":
        calls = [lambda x, q=q, s=s: mm(x, q, s) for q, s in zip(qs, scales)]
    elif way == "int8_aten_bf16":
        low = [s.bfloat16() for s in scales]
        calls = [lambda x, q=q, s=s: mm(x.bfloat16(), q, s).float() for q, s in zip(qs, low)]
    else:
        return _together(qs, scales), sum(q.numel() for q in qs)
    return calls, sum(q.numel() for q in qs)


def _together(*per: list[torch.Tensor]) -> Any:
    """One compiled function over all the linears (the way a step's graph holds them)."""

    def step(xa: torch.Tensor, xb: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
        n = len(tensors) // len(per)
        groups = [tensors[i * n : (i + 1) * n] for i in range(len(per))]
        outs = []
        for parts in zip(*groups):
            wide = parts[0].shape[-1] * (2 if parts[0].dtype == torch.uint8 else 1) == 1536
            x = xb if wide else xa
            outs.append(_reduce(x, *parts))
        return outs

    compiled = torch.compile(step, dynamic=False)
    flat = [t for ts in per for t in ts]
    return lambda xa, xb: compiled(xa, xb, *flat)


def _reduce(x: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    if parts[0].dtype == torch.int8:
        q, s = parts
        return (x * q.float()).sum(-1) * s
    nibbles, scale, zero = parts  # (N, K/2) uint8, (N, K/G), (N, K/G)
    n, half = nibbles.shape
    groups = half * 2 // GROUP
    pairs = x.reshape(1, groups, GROUP // 2, 2)
    packed = nibbles.reshape(n, groups, GROUP // 2)
    part = ((packed >> 4).float() * pairs[..., 0] + (packed & 15).float() * pairs[..., 1]).sum(-1)
    sums = x.reshape(1, groups, GROUP).sum(-1)
    return (part * scale + (zero - 8 * scale) * sums).sum(-1)


def _int4(weights: list[torch.Tensor], way: str) -> tuple[Any, int]:
    values = [torch.randint(0, 16, w.shape, dtype=torch.int32) for w in weights]
    sz = [torch.rand(w.shape[1] // GROUP, w.shape[0], 2) for w in weights]
    size = sum(v.numel() // 2 for v in values)
    if way == "int4_aten_bf16":
        packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(v, 8) for v in values]
        low = [s.bfloat16() for s in sz]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        calls = [
            lambda x, p=p, s=s: mm(x.bfloat16(), p, GROUP, s).float() for p, s in zip(packed, low)
        ]
        return calls, size
    nibbles = [(v[:, ::2] << 4 | v[:, 1::2]).to(torch.uint8) for v in values]
    scale = [s[..., 0].T.contiguous() for s in sz]
    zero = [s[..., 1].T.contiguous() for s in sz]
    return _together(nibbles, scale, zero), size


def _one(way: str, reps: int, layers: int) -> dict[str, Any]:
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(layers) for n, k in SHAPES]
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    if way == "fp32":
        calls: Any = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
        size = sum(w.nbytes for w in weights)
    elif way.startswith("int8"):
        calls, size = _int8(weights, way)
    else:
        calls, size = _int4(weights, way)

    def token() -> None:
        if callable(calls):
            calls(xs[576], xs[1536])
            return
        for call, w in zip(calls, weights):
            call(xs[w.shape[1]])

    for _ in range(3):
        token()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        token()
        times.append(time.perf_counter() - start)
    best, median = min(times), sorted(times)[len(times) // 2]
    return {"way": way, "best_ms": best * 1e3, "median_ms": median * 1e3, "mb": size / 1e6,
            "gb_s_best": size / best / 1e9, "threads": torch.get_num_threads()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, args.reps, args.layers)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} threads", file=sys.stderr)
    for way in args.ways.split(","):
        cmd = [sys.executable, __file__, "--child", way, "--reps", str(args.reps)]
        cmd += ["--layers", str(args.layers)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{way:16s} {r['best_ms']:7.1f} ms best, {r['median_ms']:7.1f} median, "
              f"{r['mb']:5.0f} MB, {r['gb_s_best']:4.1f} GB/s")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
