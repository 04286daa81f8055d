"""Where ``Precompile.load`` spends its time, phase by phase, in fresh processes.

Builds a small HF GPT-2 (``GPT2LMHeadModel``, 2 blocks, d=256, vocab 8192, no
KV cache) artifact once (or takes ``--file``), then runs each case ``--runs``
times, each in a fresh Python process:

- ``ours``: ``import torch``, ``import torch_precompile``, ``Precompile.load``
  and a first call. Inside the load, from the reader's trace
  (``torch_precompile.file.trace.recording``): the header read, each section's
  read and SHA-256 (bytes, seconds, how many times), and the load's phases
  (header, weights, guards, unpickling, kernel loading, PyTorch's full path if
  taken). The bytes hashed are also counted independently, by wrapping
  ``hashlib.sha256`` in the child process (this works on a version of the
  package without the trace, for a before/after comparison).
- ``eager``: ``import transformers``, build the model, load its ``state_dict``
  and a first call.
- ``aot_compile`` (``--torch-aot``): ``torch.compiler.load_compiled_function``
  of what torch's ``aot_compile`` + ``save_compiled_function`` wrote, on the
  eager-built model, and a first call (its Inductor cache warm from the build).

``--stack GB`` builds instead a CUDA artifact of about ``GB`` gigabytes of bf16
weights (a stack of 8192 x 8192 linear layers, ``Precompile.compile``): the load
of a large model's weights, the bytes from the page cache to the GPU and checked.

Usage (from the repository root)::

    python benchmarks/load_phases.py                     # build once, 3 runs
    python benchmarks/load_phases.py --runs 5 --torch-aot
    python benchmarks/load_phases.py --file model.pt     # any artifact; eager skipped
    python benchmarks/load_phases.py --runs 5 --baseline /work/main  # before/after
    python benchmarks/load_phases.py --preimport transformers.modeling_outputs
    python benchmarks/load_phases.py --stack 8 --runs 3 --baseline ../before  # a GPU
    python benchmarks/load_phases.py --file gen.pt --runs 7 --baseline ../before --collect-first
    python benchmarks/load_phases.py --runs 7 --baseline ../before --fresh-kernel-dir

Each load also reports the cyclic collections that ran inside it (generation and
time) and how many objects it leaves to the collector. A process's first full
collection comes when the allocation counts since start say so: it can fall inside
one version's load and after the other's; ``--collect-first`` runs it before the
load in every child, so that both sides are compared on their own work.

The children import this checkout's torch_precompile; ``--baseline DIR`` also
runs the load with the one in ``DIR`` (another checkout), interleaved. Timings are
medians over the runs (file in the page cache after the first); the counts are
those of the last run. One process runs at a time; a shared machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from harness import REPO, child_env, last_json, run_child, write_result

CONFIG = dict(
    n_layer=2,
    n_embd=256,
    n_head=4,
    vocab_size=8192,
    n_positions=128,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)

BUILD = r"""
import json, os, sys, torch, transformers as T
from torch_precompile import Precompile
work, torch_aot = sys.argv[1], sys.argv[2] == "1"
torch.manual_seed(0)
model = T.GPT2LMHeadModel(T.GPT2Config(**json.loads(sys.argv[3]))).eval()
ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(1))
torch.save(model.state_dict(), os.path.join(work, "weights.pt"))
with torch.no_grad():
    torch.save({"ids": ids, "logits": model(ids).logits}, os.path.join(work, "io.pt"))
    art = Precompile.compile(model, (ids,))
    Precompile.save(os.path.join(work, "gpt2.pt"), art)
if torch_aot:
    torch._dynamo.config.enable_aot_compile = True
    try:
        with torch.no_grad():
            fn = torch.compile(model, fullgraph=True).forward.aot_compile(((ids,), {}))
        fn.save_compiled_function(os.path.join(work, "gpt2.aot"))
    except Exception as exc:  # torch 2.13 refuses HF GPT-2 (an ID_MATCH guard)
        with open(os.path.join(work, "gpt2.aot.failed"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
"""

BUILD_STACK = r"""
import os, sys, torch
from torch_precompile import Precompile
path, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
with torch.device("cuda"):
    model = torch.nn.Sequential(
        *[torch.nn.Linear(8192, 8192, bias=False, dtype=torch.bfloat16) for _ in range(layers)]
    ).eval()
x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    Precompile.save(path, Precompile.compile(model, (x,)))
"""

CHILD = r"""
import time
t0 = time.perf_counter()
import hashlib, json, os, sys
case, path, work = sys.argv[1], sys.argv[2], sys.argv[3]
hashed = {"bytes": 0, "calls": 0}
_sha256 = hashlib.sha256
class _Counting:
    # Counts the bytes every SHA-256 in this process sees (hashlib.sha256 wrapped).
    def __init__(self, data=b"", **kw):
        self._h = _sha256(**kw)
        hashed["calls"] += 1
        self.update(data)
    def update(self, data):
        hashed["bytes"] += memoryview(data).nbytes
        self._h.update(data)
    def digest(self): return self._h.digest()
    def hexdigest(self): return self._h.hexdigest()
    def copy(self): raise NotImplementedError
    digest_size, block_size, name = 32, 64, "sha256"
if case == "ours":
    hashlib.sha256 = _Counting
import torch
t_torch = time.perf_counter()
out = {"case": case, "import_torch_s": t_torch - t0}
io = torch.load(os.path.join(work, "io.pt")) if work else None
if case == "ours":
    import torch_precompile
    from torch_precompile import Precompile
    t1 = time.perf_counter()
    out["import_package_s"] = t1 - t_torch
    out["package_file"] = torch_precompile.__file__
    if os.environ.get("LP_PREIMPORT"):  # the model's library, imported before the load
        import importlib
        for name in os.environ["LP_PREIMPORT"].split(","):
            importlib.import_module(name)
        out["preimport_s"] = time.perf_counter() - t1
    try:
        from torch_precompile.file.trace import recording
    except ImportError:  # a version without the trace: totals only
        import contextlib
        recording = contextlib.nullcontext
    import gc
    if os.environ.get("LP_COLLECT_FIRST"):  # the process's full collection, done before
        gc.collect()
    tracked = len(gc.get_objects())
    collections = []  # (generation, seconds) of each collection inside the load
    def _seen(phase, info, began=[0.0]):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - began[0]))
    gc.callbacks.append(_seen)
    with recording() as trace:
        t = time.perf_counter()
        art = Precompile.load(path)
        out["load_s"] = time.perf_counter() - t
    gc.callbacks.remove(_seen)
    out["collections"] = collections
    gc.collect()
    out["objects_left"] = len(gc.get_objects()) - tracked
    out["events"] = [] if trace is None else [vars(e) for e in trace.events]
    out["hashed_bytes"], out["hash_objects"] = hashed["bytes"], hashed["calls"]
    out["file_size"] = os.path.getsize(path)
    heavy = ("torch._dynamo", "torch._inductor.compile_fx", "sympy")
    out["heavy_modules"] = [m for m in heavy if m in sys.modules]
    call = lambda ids: art(ids)
else:
    import transformers as T
    t1 = time.perf_counter()
    out["import_package_s"] = t1 - t_torch
    t = time.perf_counter()
    model = T.GPT2LMHeadModel(T.GPT2Config(**json.loads(sys.argv[4]))).eval()
    model.load_state_dict(torch.load(os.path.join(work, "weights.pt"), weights_only=True))
    if case == "aot_compile":
        with open(os.path.join(work, "gpt2.aot"), "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        call = lambda ids: fn(model, ids)
    else:
        call = model
    out["load_s"] = time.perf_counter() - t
if io is not None:
    t = time.perf_counter()
    with torch.no_grad():
        got = call(io["ids"])
    out["first_call_s"] = time.perf_counter() - t
    out["max_abs_diff"] = float((got.logits - io["logits"]).abs().max())
out["total_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def _run(source: str, *args: str, package: str = str(REPO)) -> dict[str, Any]:
    """Run ``source`` in a fresh process importing torch_precompile from ``package``
    (``LP_FRESH_KERNEL_DIR``: with a kernel directory of its own, empty)."""
    env = child_env() | {"PYTHONPATH": package}
    fresh = None
    if os.environ.get("LP_FRESH_KERNEL_DIR"):
        fresh = tempfile.mkdtemp(prefix="lp-kernels-")
        env["TORCH_PRECOMPILE_KERNEL_DIR"] = fresh
    # ``-c`` puts the cwd first on sys.path: run from elsewhere, so ``package`` is found.
    try:
        stdout = run_child(
            textwrap.dedent(source), *args, env=env, timeout=1200, cwd=tempfile.gettempdir()
        )
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
    out = last_json(stdout) if stdout.strip() else {}
    imported = out.get("package_file")
    if imported and not Path(imported).resolve().is_relative_to(Path(package).resolve()):
        raise SystemExit(f"the child imported torch_precompile from {imported}, not from {package}")
    return out


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "    -   " if value is None else f"{value * 1e3:8.1f}"


def _report_ours(runs: list[dict[str, Any]], which: str) -> None:
    last = runs[-1]
    size = last["file_size"] / 2**20
    print(f"\nPrecompile.load of {size:.1f} MiB, {which}, median of {len(runs)} runs")
    for key, label in (
        ("import_torch_s", "import torch"),
        ("import_package_s", "import torch_precompile"),
        ("preimport_s", "import the model's library first"),
        ("load_s", "Precompile.load (all of it)"),
        ("first_call_s", "first call"),
    ):
        print(f"  {label:34s} {_ms(_median(runs, key))} ms")
    load_s = _median(runs, "load_s")
    if load_s:
        print(f"  the file over the load             {last['file_size'] / load_s / 1e9:8.2f} GB/s")
    events = last["events"]
    if not events:
        print("  (this torch_precompile records no trace: totals only)")
    phases: dict[str, list[float]] = {}
    for run in runs:
        totals: dict[str, float] = {}
        for e in run["events"]:
            if e["kind"] == "phase":
                totals[e["name"]] = totals.get(e["name"], 0.0) + e["seconds"]
        for name, seconds in totals.items():
            phases.setdefault(name, []).append(seconds)
    if phases:
        print("  phases (nested phases are inside their parent; medians):")
        for name, values in phases.items():
            print(f"    {name:32s} {_ms(statistics.median(values))} ms")
    names = [e["name"] for e in events if e["kind"] in ("read", "hash")]
    if names:
        print("  sections (last run): reads, hashes, bytes, read ms, hash ms")
        for name in dict.fromkeys(names):
            reads = [e for e in events if e["kind"] == "read" and e["name"] == name]
            hashes = [e for e in events if e["kind"] == "hash" and e["name"] == name]
            size = max((e["nbytes"] for e in reads + hashes), default=0)
            read_s = sum(e["seconds"] for e in reads)
            hash_s = sum(e["seconds"] for e in hashes)
            shown = name if len(name) <= 30 else name[:27] + "..."
            print(
                f"    {shown:30s} {len(reads):2d} {len(hashes):2d} {size:12,d} "
                f"{read_s * 1e3:8.2f} {hash_s * 1e3:8.2f}"
            )
        table = {e["name"] for e in events if e["kind"] in ("read", "hash")}
        twice = [
            n for n in table if sum(e["name"] == n and e["kind"] == "hash" for e in events) > 1
        ]
        print(f"  sections hashed more than once: {twice or 'none'}")
    print(
        f"  bytes hashed (hashlib.sha256 counted): {last['hashed_bytes']:,} "
        f"({last['hashed_bytes'] / last['file_size']:.2f}x the file)"
    )
    print(f"  compiler modules imported by the load: {last['heavy_modules'] or 'none'}")
    if "collections" in last:
        each = [", ".join(f"gen{g} {t * 1e3:.1f} ms" for g, t in r["collections"]) for r in runs]
        print(f"  cyclic collections inside the load, each run: {each}")
        left = statistics.median(r["objects_left"] for r in runs)
        print(f"  objects the load leaves to the collector: {left:,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", help="an artifact to load (default: build the GPT-2 one)")
    parser.add_argument("--work", help="where to build (default: a directory under /tmp)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--torch-aot", action="store_true", help="also torch's aot_compile load")
    parser.add_argument("--json", help="write every run's numbers to this file")
    parser.add_argument(
        "--preimport",
        help="modules to import before the load (e.g. transformers.modeling_outputs): "
        "the load phase without the model library's import",
    )
    parser.add_argument(
        "--baseline", help="also load with the torch_precompile at this path (before/after)"
    )
    parser.add_argument(
        "--stack", type=float, help="build a CUDA artifact of about this many GB of weights"
    )
    parser.add_argument(
        "--fresh-kernel-dir",
        action="store_true",
        help="each load writes its kernels' files into an empty directory of its own, as "
        "the first load on a machine does (by default the files of the first run stay)",
    )
    parser.add_argument(
        "--collect-first",
        action="store_true",
        help="gc.collect() before the load: the process's first full collection (due when "
        "the counts since import say, not when the load does) then falls in neither side",
    )
    args = parser.parse_args()
    if args.baseline:  # the children run elsewhere: an absolute path, holding the package
        args.baseline = os.path.abspath(args.baseline)
        if not os.path.isdir(os.path.join(args.baseline, "torch_precompile")):
            parser.error(f"--baseline {args.baseline} holds no torch_precompile package")
    config = json.dumps(CONFIG)
    if args.preimport:
        os.environ["LP_PREIMPORT"] = args.preimport
    if args.collect_first:
        os.environ["LP_COLLECT_FIRST"] = "1"
    if args.fresh_kernel_dir:
        os.environ["LP_FRESH_KERNEL_DIR"] = "1"
    work = ""
    path = args.file
    if args.stack:
        path = args.file or os.path.join(tempfile.gettempdir(), f"tp_stack_{args.stack:g}gb.pt")
        if not os.path.exists(path):
            layers = max(1, round(args.stack * 1e9 / (8192 * 8192 * 2)))
            print(f"building {path} ({layers} layers) ...", flush=True)
            _run(BUILD_STACK, path, str(layers))
    elif path is None:
        work = args.work or os.path.join(tempfile.gettempdir(), "tp_load_phases")
        os.makedirs(work, exist_ok=True)
        path = os.path.join(work, "gpt2.pt")
        aot = os.path.join(work, "gpt2.aot")
        need_aot = (
            args.torch_aot and not os.path.exists(aot) and not os.path.exists(aot + ".failed")
        )
        if not os.path.exists(path) or need_aot:
            print(f"building {path} (once) ...", flush=True)
            _run(BUILD, work, "1" if args.torch_aot else "0", config)
        if args.torch_aot and not os.path.exists(aot):
            print(f"torch's aot_compile failed, case skipped: {Path(aot + '.failed').read_text()}")
    with_aot = args.torch_aot and work and os.path.exists(os.path.join(work, "gpt2.aot"))
    cases = ["ours"] + (["eager"] if work else []) + (["aot_compile"] if with_aot else [])
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    if args.baseline:
        results["baseline"] = []
    for _ in range(args.runs):
        for case in cases:
            results[case].append(_run(CHILD, case, path, work, config))
        if args.baseline:  # interleaved: the same machine load for both
            results["baseline"].append(
                _run(CHILD, "ours", path, work, config, package=args.baseline)
            )
    _report_ours(results["ours"], f"this checkout ({REPO})")
    if args.baseline:
        _report_ours(results["baseline"], f"baseline ({args.baseline})")
    for case in cases[1:]:
        runs = results[case]
        print(f"\n{case}, median of {len(runs)} runs")
        print(f"  import torch                       {_ms(_median(runs, 'import_torch_s'))} ms")
        print(f"  import transformers                {_ms(_median(runs, 'import_package_s'))} ms")
        label = "build + state_dict" if case == "eager" else "build + load_compiled_function"
        print(f"  {label:34s} {_ms(_median(runs, 'load_s'))} ms")
        print(f"  first call                         {_ms(_median(runs, 'first_call_s'))} ms")
    if work:
        diffs = {c: results[c][-1].get("max_abs_diff") for c in cases}
        print(f"\nlargest |logits - eager's| per case: {diffs}")
    if args.json:
        write_result(args.json, {"runs": results})


if __name__ == "__main__":
    main()
