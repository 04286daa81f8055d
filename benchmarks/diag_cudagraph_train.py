"""Training with mode="reduce-overhead": where does it break? (diagnostic, CUDA only)

Runs fwd+bwd steps of the GPT decoder with (a) torch.compile(mode="reduce-overhead"),
(b) our artifact in the compiling process, (c) our artifact with
torch.compiler.cudagraph_mark_step_begin() instead of our generation bump. Prints one
line per variant: the step that failed (if any) and the error.
"""

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.fixtures import models
from torch_precompile import Precompile, _compat


def steps(fn, args, n=8, before=None):
    for i in range(n):
        try:
            if before:
                before()
            o = fn(*args)
            o.float().pow(2).mean().backward()
        except Exception as exc:
            return f"step {i}: {type(exc).__name__}: {str(exc)[:300]}"
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        if before:
            before()
        fn(*args).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return f"ok, {(time.perf_counter() - t) / 20 * 1e3:.3f} ms/step"


BUILDER = getattr(models, f"build_{sys.argv[1] if len(sys.argv) > 1 else 'gpt'}")


def fresh():
    model, args, _ = BUILDER()
    return model.cuda(), tuple(a.cuda() for a in args)


model, args = fresh()
print(
    "a torch.compile reduce-overhead:",
    steps(torch.compile(model, mode="reduce-overhead"), args),
    flush=True,
)
model, args = fresh()
print("a' torch.compile default:", steps(torch.compile(model), args), flush=True)
model, args = fresh()
print("eager:", steps(model, args), flush=True)
model, args = fresh()
try:
    art = Precompile.compile(model, args, mode="reduce-overhead")
    print("b ours (generation bump):", steps(art, args), flush=True)
    orig = _compat.begin_cudagraph_step
    _compat.begin_cudagraph_step = lambda: None
    print(
        "c ours (mark_step_begin):",
        steps(art, args, before=torch.compiler.cudagraph_mark_step_begin),
        flush=True,
    )
    print("d ours (no step marker):", steps(art, args), flush=True)
    _compat.begin_cudagraph_step = orig
except Exception:
    traceback.print_exc()
model, args = fresh()
art = Precompile.compile(model, args)
print("e ours default mode:", steps(art, args), flush=True)
