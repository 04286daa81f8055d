"""The staged precompile flow: each stage visible, the result saved to one file.

Compare with ``ugly.py`` (PyTorch's monolithic ``aot_compile``). Here::

    gm, bytecode, guards = torch.Precompile.dynamo(model, example_input)
    joint_gm, guards = torch.Precompile.aot_autograd(gm, guards)
    compiled_joint_gm, guards = torch.Precompile.inductor(joint_gm, guards)
    precompiled_artifact = torch.Precompile.precompile(compiled_joint_gm)
    torch.Precompile.save("/tmp/model.pt", precompiled_artifact, bytecode, guards)

    precompiled_artifact = torch.Precompile.load("/tmp/model.pt")
    precompiled_artifact(example_input)

The saved file carries the weights, so the last two lines work in a process
that never built the model: ``--fresh`` runs them in a new interpreter that
does not import the model's code. Run from the repository root:
``python beautiful.py [--fresh]``; exits non-zero if an output differs from
eager by more than 1e-4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

TOLERANCE = 1e-4

# Run by ``--fresh``: no model code is imported, only the saved file is read.
_FRESH_LOAD = """
import sys, time
t0 = time.perf_counter()
import torch
import torch_precompile  # registers torch.Precompile
loaded = torch.Precompile.load(sys.argv[1])
t1 = time.perf_counter()
ids, expected = torch.load(sys.argv[2])
with torch.no_grad():
    out = loaded(ids)
t2 = time.perf_counter()
assert "tests.fixtures.models" not in sys.modules
diff = (out - expected).abs().max().item()
print(f"[beautiful] fresh process: import + load {t1 - t0:.2f} s, first call {t2 - t1:.3f} s, "
      f"max |loaded - eager| = {diff:.1e}")
sys.exit(0 if diff <= float(sys.argv[3]) else 1)
"""


def main(fresh: bool = False) -> int:
    """Run the staged flow on the reference transformer; return the exit status."""
    import torch

    import torch_precompile  # noqa: F401  (registers torch.Precompile)
    from tests.fixtures.models import build_transformer

    model, (example_input,), _ = build_transformer()
    with torch.no_grad():
        expected = model(example_input)

    # An inference artifact: captured under no_grad.
    with torch.no_grad():
        t = time.perf_counter()
        gm, bytecode, guards = torch.Precompile.dynamo(model, example_input)
        print(
            f"[beautiful] dynamo:       {time.perf_counter() - t:6.2f} s  "
            f"({sum(n.op == 'call_function' for n in gm.graph.nodes)} ops, {len(guards)} guards)"
        )
        t = time.perf_counter()
        joint_gm, guards = torch.Precompile.aot_autograd(gm, guards)
        print(
            f"[beautiful] aot_autograd: {time.perf_counter() - t:6.2f} s  "
            f"({len(joint_gm.graph.nodes)} ATen nodes)"
        )
        t = time.perf_counter()
        compiled_joint_gm, guards = torch.Precompile.inductor(joint_gm, guards)
        print(f"[beautiful] inductor:     {time.perf_counter() - t:6.2f} s")
        t = time.perf_counter()
        precompiled_artifact = torch.Precompile.precompile(compiled_joint_gm)
        print(f"[beautiful] precompile:   {time.perf_counter() - t:6.2f} s")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        t = time.perf_counter()
        torch.Precompile.save(path, precompiled_artifact, bytecode, guards)
        print(
            f"[beautiful] save:         {time.perf_counter() - t:6.2f} s  "
            f"({os.path.getsize(path) / 1024:.0f} KiB, weights included)"
        )

        t = time.perf_counter()
        loaded = torch.Precompile.load(path)
        print(f"[beautiful] load:         {time.perf_counter() - t:6.2f} s  (in this process)")
        with torch.no_grad():
            out = loaded(example_input)
        diff = (out - expected).abs().max().item()
        status = 0 if diff <= TOLERANCE else 1
        print(
            "[beautiful] guards by stage: "
            + ", ".join(
                f"{p} {len(guards.by_phase(p))}" for p in ("dynamo", "aot_autograd", "inductor")
            )
        )

        if fresh:
            io_path = os.path.join(tmp, "io.pt")
            torch.save((example_input, expected), io_path)
            env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
            run = subprocess.run(
                [sys.executable, "-c", _FRESH_LOAD, path, io_path, str(TOLERANCE)], env=env
            )
            status = status or run.returncode

    print(
        f"beautiful.py: max |loaded - eager| = {diff:.1e} ({'OK' if status == 0 else 'MISMATCH'})"
    )
    return status


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(fresh="--fresh" in sys.argv[1:]))
