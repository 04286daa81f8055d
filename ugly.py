"""Today's precompile flow with PyTorch's own API: the monolithic flow we replace.

PyTorch can compile a model ahead of time and save the result::

    torch._dynamo.config.enable_aot_compile = True
    compiled = torch.compile(model, fullgraph=True)
    fn = compiled.forward.aot_compile(((ids,), {}))
    fn.save_compiled_function(path)
    loaded = torch.compiler.load_compiled_function(open(path, "rb"))
    loaded(model, ids)

``aot_compile`` runs Dynamo, AOTAutograd and Inductor in one opaque call: no
stage can be inspected, transformed or saved on its own, the guards are not
shown, the saved file holds no weights (the loaded function takes the live
module as its first argument), and loading it can take about as long as
compiling. ``torch_precompile`` splits this into stages (see ``beautiful.py``
and the README). This script times each step of today's flow on
``TinyTransformer`` and checks the loaded function against eager PyTorch.

Run from the repository root: ``python ugly.py``. Exits non-zero if the loaded
function's output differs from eager by more than 1e-4. Loading in the process
that compiled is quick because the kernels are already in memory; pass
``--fresh`` to also time a load and first call in a new Python process, which is
what a deployment sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

TOLERANCE = 1e-4

# Run by ``--fresh`` in a new interpreter: load the saved file and call it once.
_FRESH_LOAD = """
import sys, time
t0 = time.perf_counter()
import torch
from tests.fixtures.models import build_transformer
model, (ids,), _ = build_transformer()
with torch.no_grad(), open(sys.argv[1], "rb") as f:
    loaded = torch.compiler.load_compiled_function(f)
    out = loaded(model, ids)
    diff = (out - model(ids)).abs().max().item()
print(f"[ugly] fresh process: import, build, load and first call: "
      f"{time.perf_counter() - t0:.2f} s (max diff {diff:.1e})")
"""


def main(fresh: bool = False) -> int:
    """Run the monolithic flow step by step; return the process exit status."""
    t0 = time.perf_counter()
    import torch

    from tests.fixtures.models import build_transformer

    print(f"[ugly] import torch: {time.perf_counter() - t0:.2f} s (torch {torch.__version__})")

    t = time.perf_counter()
    model, (ids,), _ = build_transformer()  # eval mode, torch.manual_seed(0)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[ugly] build TinyTransformer ({n_params / 1e6:.2f} M parameters, "
        f"ids {tuple(ids.shape)}): {time.perf_counter() - t:.2f} s"
    )

    torch._dynamo.config.enable_aot_compile = True

    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transformer.aot")

        t = time.perf_counter()
        eager = model(ids)
        print(f"[ugly] eager forward: {time.perf_counter() - t:.3f} s")

        t = time.perf_counter()
        compiled = torch.compile(model, fullgraph=True)
        fn = compiled.forward.aot_compile(((ids,), {}))
        print(
            f"[ugly] aot_compile (Dynamo + AOTAutograd + Inductor): {time.perf_counter() - t:.2f} s"
        )

        t = time.perf_counter()
        fn.save_compiled_function(path)
        size = os.path.getsize(path)
        print(
            f"[ugly] save_compiled_function: {time.perf_counter() - t:.2f} s "
            f"({size / 1024:.1f} KiB)"
        )

        t = time.perf_counter()
        with open(path, "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        print(f"[ugly] load_compiled_function: {time.perf_counter() - t:.2f} s")

        t = time.perf_counter()
        out = loaded(model, ids)  # the compiled forward takes the module first
        print(f"[ugly] first call of the loaded function: {time.perf_counter() - t:.2f} s")

        t = time.perf_counter()
        loaded(model, ids)
        print(f"[ugly] second call of the loaded function: {time.perf_counter() - t:.4f} s")

        if fresh:
            repo_root = os.path.dirname(os.path.abspath(__file__))
            subprocess.run([sys.executable, "-c", _FRESH_LOAD, path], check=True, cwd=repo_root)

    diff = (out - eager).abs().max().item()
    ok = diff <= TOLERANCE
    print(f"[ugly] total: {time.perf_counter() - t0:.2f} s")
    print(f"ugly.py: max |loaded - eager| = {diff:.1e} ({'OK' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(fresh="--fresh" in sys.argv[1:]))
