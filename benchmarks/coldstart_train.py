"""First backward of a CPU training artifact after a fresh load, vs eager's.

Each run is a fresh process; the time counts from just before the process is
spawned to the end of the first ``backward()`` (``import torch`` included).
``eager`` builds the reference transformer (dropout 0) and runs forward +
backward; ``ours`` runs ``Precompile.load(path)`` (standalone) and the same.
Medians of ``--runs`` runs, printed as one line per case and the ratio.

Usage (from the repository root)::

    python benchmarks/coldstart_train.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from harness import REPO, child_env, run_child, spread

CHILD = r"""
import sys, time, torch
case, path = sys.argv[1:3]
torch.manual_seed(1)
ids = torch.randint(0, 1000, (2, 32))
if case == "eager":
    from tests.fixtures.models import build_transformer
    fn = build_transformer()[0].train()
else:
    from torch_precompile import Precompile
    fn = Precompile.load(path)
fn(ids).float().pow(2).mean().backward()
print("DONE", time.time())
"""


def _build(path: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    from tests.fixtures.models import build_transformer
    from torch_precompile import Precompile

    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 32))
    model = build_transformer()[0].train()
    d = Precompile.dynamo(model, (ids,))
    i = Precompile.inductor(Precompile.aot_autograd(d))
    Precompile.save(path, Precompile.precompile(i), d.bytecode, i.guards)


def _run(case: str, path: str) -> float:
    start = time.time()
    out = run_child(CHILD, case, path, env=child_env())
    done = float(next(ln for ln in out.splitlines() if ln.startswith("DONE")).split()[1])
    return done - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transformer_train.pt2")
        _build(path)
        _run("ours", path)  # untimed: page cache and kernel directory warm, as for eager's
        medians = {}
        for case in ("eager", "ours"):
            times = [_run(case, path) for _ in range(args.runs)]
            medians[case] = spread(times)["median"]
            print(f"{case}: median {medians[case]:.3f} s  ({', '.join(f'{t:.3f}' for t in times)})")
        print(f"ours / eager: {medians['ours'] / medians['eager']:.2f}x")


if __name__ == "__main__":
    main()
