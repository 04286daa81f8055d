"""Distributed artifacts: compile once vs per rank, first output of a fresh job.

For each world size (torchrun jobs of ``tests/fixtures/dist_job.py``: on CPU with gloo, or
with ``TP_DEVICE=cuda`` on one GPU per rank with NCCL):

- *compile once* (empty Inductor cache): rank 0 alone compiles the tensor-parallel MLP, block
  and Hugging Face Llama (``Precompile.compile``) and saves, every rank writes its shard: the
  job's wall time and rank 0's compile seconds;
- *compile per rank* (one empty Inductor cache shared by the job's ranks; not run for one
  rank): every rank compiles the same programs, as a job without a shared
  artifact does (all ranks share the machine's cores);
- *first output*, of the block and of the Llama: a fresh job per case, from ``torchrun`` start
  to the end (wall), and each rank's seconds from process start to its first output
  (the slowest rank): ``eager`` (build + ``parallelize_module``),
  ``jit`` (that + ``torch.compile``, empty Inductor cache) and ``ours``
  (``Precompile.load`` of the saved files, empty Inductor cache, no C++
  compiler; whether the lean path served it on every rank, and the ratio to
  eager); medians of ``--runs``, the cases interleaved run by run;
- file sizes: the code file and one rank's shard.

Usage (from the repository root)::

    python benchmarks/distributed.py --worlds 2 4 --runs 3
    TP_DEVICE=cuda python benchmarks/distributed.py --worlds 1 2 --runs 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import child_env, write_result

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "fixtures" / "dist_job.py"
HOWS = ("eager", "jit", "ours")
FIRST = ("block", "llama")  # the models whose first output is timed
COMPILED = ("mlp", "block", "llama")  # the compile columns


def torchrun(world: int, *args: str, cache: Path, **extra: str) -> float:
    """Run one job, its compiler caches empty under ``cache``; its wall time in seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", str(JOB), *args]
    full_env = child_env(cache, **extra)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def ranks(out: Path, phase: str, world: int) -> list[dict[str, Any]]:
    results = [
        json.loads((out / f"{phase}-{world}-rank{r}.json").read_text()) for r in range(world)
    ]
    for res in results:
        if "error" in res:
            raise RuntimeError(res["error"])
    return results


def measure(world: int, runs: int, tmp: Path, per_rank: bool = True) -> dict[str, Any]:
    out = tmp / f"world{world}"
    out.mkdir()
    row: dict[str, Any] = {"world": world}
    # Compiles start from an empty Inductor cache, as on a first deployment.
    wall = torchrun(world, "build", str(out), cache=tmp / f"cache-{world}-build")
    build = ranks(out, "build", world)[0]
    row["compile_once"] = {
        "job_wall_s": wall,
        "rank0_compile_s": build["compile_s"],
        "compiles": 1,
    }
    if world > 1 and per_rank:  # one rank: compiling once is compiling per rank
        wall = torchrun(world, "compile_all", str(out), cache=tmp / f"cache-{world}-compile-all")
        per_rank = ranks(out, "compile_all", world)
        row["compile_per_rank"] = {
            "job_wall_s": wall,
            "slowest_rank_compile_s": {
                name: max(r["compile_s"][name] for r in per_rank) for name in COMPILED
            },
            "compiles": world,
        }
    for model in FIRST:
        row[f"first_output_{model}"] = first_output(world, runs, tmp, out, model)
    row["file_bytes"] = {
        name: {
            "code_file": (out / f"{name}.pt").stat().st_size,
            "shard_rank0": (out / f"{name}.pt.rank0-of-{world}").stat().st_size,
        }
        for name in ("mlp", "block", "llama", "train")
    }
    return row


def first_output(world: int, runs: int, tmp: Path, out: Path, model: str) -> dict[str, Any]:
    """Seconds to ``model``'s first output in fresh jobs, per case (medians of ``runs``)."""
    first: dict[str, Any] = {}
    # Interleaved (eager, jit, ours, eager, ...): a load change on the shared machine
    # falls on every case alike.
    walls: dict[str, list[float]] = {how: [] for how in HOWS}
    firsts: dict[str, list[float]] = {how: [] for how in HOWS}
    lean: list[bool] = []
    heavy: dict[str, set[str]] = {how: set() for how in HOWS}
    for i in range(runs):
        for how in HOWS:
            cache = tmp / f"cache-{world}-{model}-{how}-{i}"
            extra = {"CXX": "/bin/false"} if how == "ours" else {}  # nothing may compile
            walls[how].append(torchrun(world, "first", str(out), how, model, cache=cache, **extra))
            results = ranks(out, f"first-{how}-{model}", world)
            firsts[how].append(max(r["first_output_s"] for r in results))
            for r in results:
                heavy[how].update(r["heavy_imported"])
                if how == "ours":
                    lean.append(r["lean"])
    for how in HOWS:
        first[how] = {
            "job_wall_s": statistics.median(walls[how]),
            "slowest_rank_first_output_s": statistics.median(firsts[how]),
            "runs": runs,
            "heavy_modules_imported": sorted(heavy[how]),
        }
    # Every rank of every "ours" job ran the lean path (no Dynamo,
    # AOTAutograd or Inductor of ours; what DTensor itself imports, eager imports too).
    first["ours"]["lean_on_every_rank"] = all(lean)
    first["ours"]["vs_eager"] = (
        first["ours"]["slowest_rank_first_output_s"] / first["eager"]["slowest_rank_first_output_s"]
    )
    return first


def _first(case: dict[str, Any]) -> str:
    return f"{case['slowest_rank_first_output_s']:.1f} s (job {case['job_wall_s']:.1f} s)"


def table(result: dict[str, Any]) -> str:
    """The README's markdown table of a results file (one line per world size and model)."""
    lines = [
        "| ranks | model | compile once (rank 0) | compile per rank (slowest rank) "
        "| first output, eager | first output, torch.compile | first output, ours (lean) "
        "| ours / eager | code file / shard |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        once = row["compile_once"]["rank0_compile_s"]
        per = row.get("compile_per_rank", {}).get("slowest_rank_compile_s")
        for model in FIRST:
            first = row.get(f"first_output_{model}")
            if first is None:  # a results file from before the Llama was measured
                continue
            # the block's line also counts the MLP (compiled with it, as before)
            names = ("mlp", "block") if model == "block" else (model,)
            size = row["file_bytes"][model]
            ours = first["ours"]
            cells = [
                str(row["world"]),
                "block (+ MLP compile)" if model == "block" else "HF Llama",
                f"{sum(once[n] for n in names):.1f} s, 1 compile",
                f"{sum(per[n] for n in names):.1f} s, {row['world']} compiles"
                if per
                else "(1 rank)",
                *(_first(first[h]) for h in HOWS[:2]),
                _first(ours) + ("" if ours.get("lean_on_every_rank") else ", not lean everywhere"),
                f"{ours['vs_eager']:.2f}x" if "vs_eager" in ours else "",
                f"{size['code_file'] / 1024:.0f} KiB / {size['shard_rank0'] / 1024:.0f} KiB",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--table", action="store_true", help="print the README table of --out and exit"
    )
    parser.add_argument(
        "--no-compile-per-rank",
        action="store_true",
        help="leave out the job where every rank compiles (the longest part on GPUs)",
    )
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "distributed_2026-11-23_cpu.json")
    )
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return
    import torch

    load_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            row = measure(world, args.runs, Path(tmp), per_rank=not args.no_compile_per_rank)
            rows.append(row)
            print(json.dumps(row, indent=1), flush=True)
    result = {
        "load_average": f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
        "backend": "NCCL, one GPU per rank"
        if os.environ.get("TP_DEVICE") == "cuda"
        else "gloo (CPU), 1 thread per rank",
        "rows": rows,
    }
    if os.environ.get("TP_DEVICE") == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        result["backend"] = f"NCCL {nccl}, one GPU per rank"
        result["gpu"] = torch.cuda.get_device_name(0)
        result["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.split()[0]
    write_result(args.out, result)
    print(f"wrote {args.out}")
    print(table(result))


if __name__ == "__main__":
    main()
