"""Decode attention of a Qwen2.5-0.5B layer, six ways, each in one CUDA graph.

One query token a row, 14 query heads sharing 2 key/value heads (head_dim 64)
over a static cache of 352 positions with a boolean mask, bf16; 24 layers
chained (each layer's own cache, so nothing stays in L2), captured in a CUDA
graph and replayed 200 times. Per layer it prints the replay time, the summed
kernel time from ``torch.profiler``, the kernels, and the largest difference
from float32 attention:

- ``current``: transformers' SDPA path, ``repeat_kv`` then
  ``scaled_dot_product_attention`` (what a decode step ran before
  ``generation/decode_attention.py``);
- ``gqa``: SDPA's own ``enable_gqa=True`` (eager only: under compile it
  repeats the heads itself);
- ``packed``: the group laid along the query axis, then SDPA;
- ``manual``: the same as sums Inductor can fuse (no matmul);
- ``manual_mm``: the same with two matmuls and a float32 softmax, what
  ``decode_attention.py`` writes into the graph;
- ``flex``: ``flex_attention`` with ``enable_gqa=True`` and the mask as a
  ``score_mod``, no block mask (compiled only);

eager (with each SDPA backend forced where it applies) and under
``torch.compile`` with ``coordinate_descent_tuning`` as the generator builds.

Usage (a CUDA machine)::

    python benchmarks/decode_attention.py --batch 1
    python benchmarks/decode_attention.py --batch 1 --only manual_mm,flex  # compiled ways
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
from torch.profiler import ProfilerActivity, profile

LENGTH, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 352, 14, 2, 64, 24
GROUP = HEADS // KV_HEADS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--only", default="", help="the compiled ways to measure (no eager), by name")
    a = p.parse_args()
    faulthandler.dump_traceback_later(225)
    torch.manual_seed(0)
    b = a.batch
    shape = (b, KV_HEADS, LENGTH, HEAD_DIM)
    keys = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    query = torch.randn(b, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    last = torch.tensor([200 + 7 * r for r in range(b)], device="cuda")
    mask = (torch.arange(LENGTH, device="cuda")[None, :] <= last[:, None])[:, None, None, :]

    def repeat(x: torch.Tensor) -> torch.Tensor:
        return (
            x[:, :, None]
            .expand(b, KV_HEADS, GROUP, LENGTH, HEAD_DIM)
            .reshape(b, HEADS, LENGTH, HEAD_DIM)
        )

    def chain(one: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(q: torch.Tensor, m: torch.Tensor, ks=keys, vs=values) -> torch.Tensor:
            for k, v in zip(ks, vs):
                q = one(q, k, v, m)
            return q

        return run

    def current(q, k, v, m):
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=m)

    def gqa(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    def packed(q, k, v, m):
        grouped = q.reshape(b, KV_HEADS, GROUP, HEAD_DIM)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=m)
        return out.reshape(b, HEADS, 1, HEAD_DIM)

    def manual(q, k, v, m):
        grouped = q.reshape(b, KV_HEADS, GROUP, 1, HEAD_DIM).float()
        s = (grouped * k[:, :, None].float()).sum(-1) / math.sqrt(HEAD_DIM)
        weights = torch.softmax(s.masked_fill(~m, float("-inf")), -1)
        out = (weights[..., None] * v[:, :, None].float()).sum(-2)
        return out.to(q.dtype).reshape(b, HEADS, 1, HEAD_DIM)

    def manual_mm(q, k, v, m):
        grouped = q.reshape(b, KV_HEADS, GROUP, HEAD_DIM)
        s = (grouped @ k.transpose(-1, -2)).float() / math.sqrt(HEAD_DIM)
        weights = torch.softmax(s.masked_fill(~m, float("-inf")), -1).to(q.dtype)
        return (weights @ v).reshape(b, HEADS, 1, HEAD_DIM)

    def flex(q, k, v, m):
        def masked(score, row, head, q_idx, kv_idx):
            return torch.where(m[row, 0, 0, kv_idx], score, -float("inf"))

        return flex_attention(q, k, v, score_mod=masked, enable_gqa=True)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        exact = chain(current)(
            query.float(), mask, [k.float() for k in keys], [v.float() for v in values]
        )

    def measure(name: str, fn: Callable[..., torch.Tensor], backend: SDPBackend | None) -> None:
        try:
            with torch.no_grad(), sdpa_kernel(backend) if backend else torch.no_grad():
                for _ in range(3):
                    fn(query, mask)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fn(query, mask)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(200):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / 200 * 1000 / LAYERS
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
        except Exception as exc:  # a backend that does not take these inputs
            print(f"{name:28s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for e in events:
            busy[e.name] += e.device_time
            count[e.name] += 1
        err = (out.float() - exact).abs().max().item()
        print(
            f"{name:28s} batch {b} replay/layer {wall:6.2f} us  busy/layer "
            f"{sum(busy.values()) / 10 / LAYERS:6.2f} us  kernels/layer "
            f"{len(events) / 10 / LAYERS:4.1f}  max err {err:.3g}",
            flush=True,
        )
        for k, v in busy.most_common(3):
            print(f"      {v / count[k]:6.2f} us x{count[k] / 10 / LAYERS:.1f}  {k[:90]}")

    backends = (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.MATH,
    )
    only = [w for w in a.only.split(",") if w]
    if not only:
        for name, one in (("current", current), ("gqa", gqa), ("packed", packed)):
            measure(f"{name} eager", chain(one), None)
            for backend in backends:
                measure(f"{name} {backend.name}", chain(one), backend)
        measure("manual_mm eager", chain(manual_mm), None)
    options = {"coordinate_descent_tuning": True}
    for name, one in (
        ("current", current),
        ("packed", packed),
        ("manual", manual),
        ("manual_mm", manual_mm),
        ("flex", flex),
    ):
        if only and name not in only:
            continue
        torch.compiler.reset()
        measure(
            f"{name} compiled", torch.compile(chain(one), options=options, fullgraph=True), None
        )


if __name__ == "__main__":
    main()
