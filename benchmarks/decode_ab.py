"""Decode speed of two (or more) generator files, interleaved in one process.

Separate fresh processes on a lent GPU machine differ by more than the change
being measured (the same 0.5B file decoded at 727 and 824 tokens/s in two
processes of one run). This loads every file into one process and alternates
between them, round by round (the order reversed every other round), so each
file sees the same host and clocks:

- per round and file: ``generate`` of 2 tokens, then of ``--new-tokens``; decode
  tokens/s = ``(new - 2) / (t(new) - t(2))`` (prefill left out); the median of
  ``--rounds`` is reported;
- the first step's logits of each file against the first file's (greedy tokens
  in bf16 may differ after a few steps when sums run in another order);
- with ``--kernels``: the CUDA kernels of 33 tokens and their summed busy time,
  from ``torch.profiler``;
- ``--every-step NAME``: that file's decode loop checks the artifact's guards at
  every step, as before ``runtime/loop.py`` (the same file may be given twice,
  under two names, to measure the guard check alone).

Usage (a CUDA machine, files built with the same ``max_length``)::

    python benchmarks/decode_ab.py fused=/tmp/a/generator.pt plain=/tmp/b/generator.pt \\
        --prompt 96 --new-tokens 256 --rounds 8 --kernels --out decode_ab.json
    python benchmarks/decode_ab.py fused=... plain=... --batch 8  # rows of the same length
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", help="NAME=PATH of each generator file")
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="rows a generate (tokens/s counts all)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", default="cuda", help="where the files' generators run")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU files)")
    p.add_argument("--kernels", action="store_true", help="count each file's CUDA kernels")
    p.add_argument("--out", default=None, help="a JSON of the results")
    p.add_argument(
        "--every-step", default="", help="names (comma-separated) checking guards every step"
    )
    a = p.parse_args()

    import torch

    from torch_precompile import Precompile

    if a.threads:
        torch.set_num_threads(a.threads)
    gens = {}
    for spec in a.files:
        name, _, path = spec.partition("=")
        gens[name] = Precompile.load(path)
    for name in filter(None, a.every_step.split(",")):
        gens[name]._loop = every_step_loop(gens[name])  # what generate steps through

    torch.manual_seed(0)
    ids = torch.randint(10, 1000, (a.batch, a.prompt), device=a.device)
    mask = torch.ones_like(ids)

    def run(g, n: int) -> None:
        g.generate(ids, mask, max_new_tokens=n, do_sample=False)

    rates = interleaved_rates(
        gens, run, rounds=a.rounds, new=a.new_tokens, device=a.device, rows=a.batch
    )
    results: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "files": a.files,
        "every_step": a.every_step,
        "prompt": a.prompt,
        "batch": a.batch,
        "new_tokens": a.new_tokens,
        "rounds": a.rounds,
        "decode_tokens_per_s": {n: statistics.median(v) for n, v in rates.items()},
        "decode_tokens_per_s_rounds": rates,
    }
    first = None
    for name, g in gens.items():
        out = g.generate(
            ids, mask, max_new_tokens=1, output_logits=True, return_dict_in_generate=True
        )
        logits = out.logits[0].float()
        first = logits if first is None else first
        results.setdefault("first_logits_max_difference", {})[name] = float(
            (logits - first).abs().max()
        )
    if a.kernels and a.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for name, g in gens.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.generate(ids, mask, max_new_tokens=33, do_sample=False)
                torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            results.setdefault("kernels_33_tokens", {})[name] = {
                "count": len(events),
                "busy_ms": sum(e.device_time for e in events) / 1000,
            }
    print(json.dumps(results, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def interleaved_rates(
    gens: dict, run, *, rounds: int, new: int, device: str, rows: int = 1
) -> dict[str, list[float]]:
    """Each generator's decode tokens/s, a figure a round: after a warm-up ``run(g,
    new)`` each, per round and generator (in turn, the order reversed every other
    round) ``run(g, 2)`` then ``run(g, new)``; ``(new - 2) * rows / (t(new) - t(2))``."""
    import torch

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for g in gens.values():  # warm-up: CUDA graphs recorded, kernels loaded
        run(g, new)
    rates: dict[str, list[float]] = {name: [] for name in gens}
    for r in range(rounds):
        order = list(gens.items()) if r % 2 == 0 else list(reversed(gens.items()))
        for name, g in order:
            synchronize()
            t0 = time.perf_counter()
            run(g, 2)
            synchronize()
            t1 = time.perf_counter()
            run(g, new)
            synchronize()
            t2 = time.perf_counter()
            rates[name].append((new - 2) * rows / ((t2 - t1) - (t1 - t0)))
    return rates


def every_step_loop(g):
    """``Generator._loop`` as it was before ``LoopCall``: the full path at every step."""

    def loop(fixed):
        fixed = tuple(fixed)
        return lambda *moving: g.run_step(*moving, *fixed)

    return loop


if __name__ == "__main__":
    main()
