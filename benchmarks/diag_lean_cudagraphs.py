"""Diagnostic (not a benchmark): the lean load of ``mode="reduce-overhead"`` artifacts.

Builds the KV-cache step and the transformer with ``mode="reduce-overhead"``,
then in fresh processes: steps the KV cache beside eager and prints, per step,
the output and cache differences and the CUDA graphs recorded; and profiles
the transformer's calls (where a call's time goes, by function).

Usage (a CUDA machine): ``python benchmarks/diag_lean_cudagraphs.py``
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KV = r"""
import sys, torch
from tests.fixtures import models
from torch_precompile import Precompile
from torch_precompile.lean import cudagraphs as lean_cudagraphs
art = Precompile.load(sys.argv[1])
print("lean", type(art.compiled_function).__name__)
eager = models.build_kv_cache_step()[0].cuda()
bufs = dict(art.named_buffers())
with torch.no_grad():
    for step in range(5):
        x, pos = torch.randn(1, 1, 32, device="cuda"), torch.tensor([step], device="cuda")
        out = art(x, pos).clone()
        ref = eager(x, pos)
        print(step, "out", (out - ref).abs().max().item(),
              "k_cache", (bufs["k_cache"] - eager.k_cache).abs().max().item(),
              "steps", int(bufs["steps"]), int(eager.steps), dict(lean_cudagraphs.STATS))
"""

PROFILE = r"""
import cProfile, pstats, sys, time, torch
from tests.fixtures import models
from torch_precompile import Precompile
art = Precompile.load(sys.argv[1])
model, (ids,), _ = models.build_transformer()
ids = ids.cuda()
with torch.no_grad():
    for _ in range(20):
        art(ids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(300):
        art(ids)
    torch.cuda.synchronize()
    print("per call us", (time.perf_counter() - t) / 300 * 1e6)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        art(ids)
    torch.cuda.synchronize()
    prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
"""


def main() -> int:
    sys.path.insert(0, ROOT)
    import torch

    from tests.fixtures import models
    from torch_precompile import Precompile
    from torch_precompile.file import read_artifact

    tmp = tempfile.mkdtemp(prefix="diag_ro_")
    paths = {}
    with torch.no_grad():
        for name, builder in (("kv", models.build_kv_cache_step), ("tf", models.build_transformer)):
            model, args, _ = builder()
            model = model.cuda()
            args = tuple(a.cuda() for a in args)
            art = Precompile.compile(model, args, mode="reduce-overhead")
            paths[name] = os.path.join(tmp, f"{name}.pt")
            Precompile.save(paths[name], art)
            _, sections = read_artifact(paths[name])
            spec = pickle.loads(sections["fastload"])
            print(name, "cudagraphs", spec.get("cudagraphs"), "mutated", spec.get("mutated_inputs"))
            print(name, "inputs_to_check", spec.get("inputs_to_check"))
            if name == "kv":
                main_code = spec["wrapper"].split("async_compile.wait(globals())")[-1]
                print("\n".join(main_code.splitlines()[:80]))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for script, path in ((KV, paths["kv"]), (PROFILE, paths["tf"])):
        proc = subprocess.run(
            [sys.executable, "-c", script, path], env=env, capture_output=True, text=True, cwd=ROOT
        )
        print(proc.stdout[-6000:])
        if proc.returncode:
            print(proc.stderr[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
