"""Why does aoti_load_package crash in a fresh process? (diagnostic, CUDA only)"""

import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.fixtures.models import build_transformer  # noqa: E402

tmp = tempfile.mkdtemp()
model, args, _ = build_transformer()
model = model.cuda()
args = tuple(a.cuda() for a in args)
with torch.no_grad():
    ep = torch.export.export(model, args)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "m.pt2"))
    m = torch._inductor.aoti_load_package(path)
    print("in-process:", (m(*args) - model(*args)).abs().max().item(), flush=True)

CHILD = """
import faulthandler, sys; faulthandler.enable()
import torch
from tests.fixtures.models import build_transformer
print("step import", flush=True)
model, args, _ = build_transformer(); args = tuple(a.cuda() for a in args)
if "init" in sys.argv: torch.zeros(1, device="cuda")
print("step build", flush=True)
m = torch._inductor.aoti_load_package(sys.argv[1])
print("step load", flush=True)
with torch.no_grad():
    out = m(*args)
torch.cuda.synchronize()
print("step run", out.shape, flush=True)
"""
for name, extra_env, extra_args in [
    ("plain", {}, []),
    ("empty caches", {"TORCHINDUCTOR_CACHE_DIR": tmp + "/ic", "TRITON_CACHE_DIR": tmp + "/tc"}, []),
    ("cuda init first", {}, ["init"]),
]:
    env = dict(os.environ, PYTHONPATH=ROOT, **extra_env)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, path, *extra_args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(
        f"child {name}: rc={p.returncode}",
        p.stdout.strip().replace("\n", " | "),
        "||",
        p.stderr[-1200:],
        flush=True,
    )
