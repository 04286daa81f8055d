"""Where a generator's decode time goes on a GPU: tokens/s and a per-kernel table.

Loads every generator file into one process and, per batch:

- decode tokens/s as ``decode_ab.py`` measures them (``interleaved_rates``: per round
  and file, ``generate`` of 2 tokens, then of 256; ``254 * batch / (t(256) - t(2))``),
  the median of ``--rounds``;
- ``torch.profiler``'s CUDA kernels of a ``generate`` of ``--tokens + 1`` tokens less
  those of a 1-token ``generate`` (the prefill and the loop's setup): per decode token,
  each kernel's count and microseconds, their sums, the span from the first kernel's
  start to the last one's end (the profiler's host overhead included), and the largest
  idle gaps between two kernels.

Usage (a CUDA machine, files built with ``max_length`` of at least 352)::

    python benchmarks/decode_kernels.py main=/tmp/gw/qwen05/generator.pt --out kernels.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import statistics
import time

from decode_ab import interleaved_rates

PROMPT, NEW = 96, 256


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", help="NAME=PATH of each generator file")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens profiled")
    p.add_argument("--out", default=None, help="a JSON of the results")
    a = p.parse_args()

    import torch

    from torch_precompile import Precompile

    out: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "files": a.files,
    }
    gens = {}
    for spec in a.files:
        name, _, path = spec.partition("=")
        began = time.perf_counter()
        gens[name] = Precompile.load(path)
        out[f"{name} load_s"] = time.perf_counter() - began
    torch.manual_seed(0)
    for batch in (int(b) for b in a.batches.split(",")):
        ids = torch.randint(10, 1000, (batch, PROMPT), device="cuda")
        mask = torch.ones_like(ids)

        def run(g, n: int, ids=ids, mask=mask) -> None:
            g.generate(ids, mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        rates = interleaved_rates(gens, run, rounds=a.rounds, new=NEW, device="cuda", rows=batch)
        for name, g in gens.items():
            key = f"{name} b{batch}"
            out[f"{key} tokens/s"] = [round(x) for x in rates[name]]
            out[f"{key} median"] = statistics.median(rates[name])
            out.update({f"{key} {k}": v for k, v in profile(g, run, a.tokens).items()})
        print(json.dumps({k: v for k, v in out.items() if not k.endswith(("table", "gaps"))}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def profile(g, run, tokens: int) -> dict:
    """Per decode token: each kernel's count and microseconds, their sums, the span."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def kernels(n: int) -> list:
        run(g, 1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(g, n)
            torch.cuda.synchronize()
        return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    many, one = kernels(tokens + 1), kernels(1)
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for events, sign in ((many, 1), (one, -1)):
        for e in events:
            table[e.name][0] += sign
            table[e.name][1] += sign * e.device_time
    ordered = sorted(many, key=lambda e: e.time_range.start)
    gaps: dict[str, float] = collections.defaultdict(float)
    for x, y in itertools.pairwise(ordered):
        if y.time_range.start > x.time_range.end:
            gaps[f"{x.name[:60]} -> {y.name[:60]}"] += y.time_range.start - x.time_range.end
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    span = ordered[-1].time_range.end - ordered[0].time_range.start
    return {
        "kernels/token": sum(v[0] for v in table.values()) / tokens,
        "busy us/token": sum(v[1] for v in table.values()) / tokens,
        "span us/token": span / (tokens + 1),
        "table": [(k[:110], round(v[0] / tokens, 2), round(v[1] / tokens, 2)) for k, v in rows],
        "gaps": sorted(
            ((k, round(v / (tokens + 1), 2)) for k, v in gaps.items()), key=lambda kv: -kv[1]
        )[:25],
    }


if __name__ == "__main__":
    main()
