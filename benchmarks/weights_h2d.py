"""How weights should reach the GPU at load: several ways from a file, fresh processes.

Each way reads a block of ``--sizes`` MiB from a file (in the page cache: the
file was just written, as a served model's file is after its first start) and
leaves it on ``cuda:0``; the time runs from after CUDA's context exists to a
synchronised copy, with the host memory each way allocates.

- ``pageable``: read the bytes into ordinary memory, one copy to the GPU (what
  ``torch_precompile`` did before this benchmark);
- ``pinned``: read into page-locked memory of the whole size, one copy;
- ``mapped``: ``torch.from_file`` (a private mapping), one copy;
- ``staged``: two page-locked 64 MiB buffers; reading one chunk overlaps the
  copy of the previous one;
- ``package``: what ``Precompile.load`` does with a file's weights: the file
  mapped, ``lean/standin/h2d.copy_to_device`` (page-locked buffers filled from the
  mapping in turn);
- ``tree``: the SHA-256 tree of the mapping alone (``file/treehash``, every core);
- ``package+tree``: both at once, as a load runs them (the check on a thread);
- ``populate+tree``: as ``package+tree``, the mapping first faulted in by
  ``madvise(MADV_POPULATE_READ)`` on 8 threads (Linux 5.14+);
- ``package+tree/8``: as ``package+tree`` with 8 threads each (torch's, the tree's);
- ``checked``: what ``Precompile.load`` does since 2026-11-28 (``copy_checked``): each
  worker (one a core, up to 16) takes a leaf of the tree, copies it from the mapping
  into its own page-locked pieces, hashes each piece there and sends it to the device,
  so the mapping is read once; the digest is compared with ``tree_sha256``'s after the
  timing (``digest_equal``). An earlier try (``hash-staged``: one thread filling 64
  MiB buffers, 8 hashing) reached 3.9 GB/s (results of 2026-11-28).

Usage (a CUDA machine)::

    PYTHONPATH=. python benchmarks/weights_h2d.py --sizes 256,1024 --repeats 3 --out report.json
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

from harness import child_env

WAYS = (
    *("pageable", "pinned", "mapped", "staged"),
    *("package", "tree", "package+tree", "populate+tree", "package+tree/8", "checked"),
)

CHILD = r"""
import ctypes, json, sys, time
import torch
# The package's modules are imported before the timing, as a load has them.
from torch_precompile.file import treehash
from torch_precompile.file.treehash import CHUNK, TreeCheck, tree_sha256
from torch_precompile.lean.standin.h2d import copy_checked, copy_to_device
way, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
if way == "pageable":
    with open(path, "rb", buffering=0) as f:
        data = bytearray(n)
        f.readinto(data)
    out = torch.frombuffer(data, dtype=torch.uint8).to("cuda")
elif way == "pinned":
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    view = memoryview((ctypes.c_char * n).from_address(host.data_ptr())).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.readinto(view)
    out = host.to("cuda", non_blocking=True)
elif way == "mapped":
    host = torch.from_file(path, shared=False, size=n, dtype=torch.uint8)
    out = host.to("cuda")
elif way == "checked":
    import mmap, warnings
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(view, dtype=torch.uint8)
    check = TreeCheck(view, CHUNK, "")
    out = copy_checked(source, (0, n), "cuda", check)
    staged_digest = check.digest()
elif way in ("package", "tree", "package+tree", "populate+tree", "package+tree/8"):
    import mmap, threading, warnings
    if way.endswith("/8"):
        torch.set_num_threads(8)
        treehash.cores = lambda: 8
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(m)
    if way.startswith("populate"):
        step = -(-n // 8 // (2 << 20)) * (2 << 20)
        spans = [(22, a, min(step, n - a)) for a in range(0, n, step)]
        fill = [threading.Thread(target=m.madvise, args=span) for span in spans]
        [th.start() for th in fill]
        [th.join() for th in fill]
    checker = None
    if "tree" in way:
        checker = threading.Thread(target=tree_sha256, args=(view,))
        checker.start()
    out = None
    if way != "tree":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = copy_to_device(torch.frombuffer(view, dtype=torch.uint8), "cuda")
    if checker is not None:
        checker.join()
else:  # staged
    chunk = 64 << 20
    out = torch.empty(n, dtype=torch.uint8, device="cuda")
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = [memoryview((ctypes.c_char * chunk).from_address(b.data_ptr())).cast("B") for b in bufs]
    done = [torch.cuda.Event(), torch.cuda.Event()]
    stream = torch.cuda.Stream()
    with open(path, "rb", buffering=0) as f:
        pos, i = 0, 0
        while pos < n:
            k = min(chunk, n - pos)
            done[i].synchronize()  # the copy out of this buffer has finished
            got = f.readinto(views[i][:k])
            assert got == k
            with torch.cuda.stream(stream):
                out[pos : pos + k].copy_(bufs[i][:k], non_blocking=True)
                done[i].record(stream)
            pos, i = pos + k, 1 - i
    stream.synchronize()
torch.cuda.synchronize()
elapsed = time.perf_counter() - t
check = None if out is None else int(out[:: max(1, n // 4096)].sum().item())
result = {"s": elapsed, "check": check}
if way == "checked":
    result["digest_equal"] = staged_digest == treehash.tree_sha256(view)
print(json.dumps(result))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024", help="MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help="a subset of " + ", ".join(WAYS))
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    ways = [w for w in opts.ways.split(",") if w]
    if set(ways) - set(WAYS):
        parser.error(f"unknown ways {sorted(set(ways) - set(WAYS))}")
    import torch

    report: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "results": {},
    }
    tmp = tempfile.mkdtemp(prefix="h2d_")
    for mib in (int(s) for s in opts.sizes.split(",")):
        n = mib << 20
        path = os.path.join(tmp, f"{mib}.bin")
        with open(path, "wb") as f:
            for _ in range(0, n, 256 << 20):
                f.write(os.urandom(min(256 << 20, n - f.tell())))
        row: dict = {}
        checks = set()
        for way in ways:
            times = []
            for _ in range(opts.repeats):
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, way, path, str(n)],
                    env=child_env(),
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if proc.returncode != 0:
                    row[way] = {"error": proc.stderr[-500:]}
                    break
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                times.append(res["s"])
                if "digest_equal" in res:
                    row.setdefault("digest_equal", []).append(res["digest_equal"])
                if res["check"] is not None:
                    checks.add(res["check"])
            else:
                med = statistics.median(times)
                row[way] = {"median_s": med, "runs_s": times, "GBps": n / med / 1e9}
        row["same_bytes_on_gpu"] = len(checks) == 1
        report["results"][f"{mib} MiB"] = row
        os.remove(path)
        print(
            f"{mib} MiB: "
            + ", ".join(
                f"{w} {row[w]['median_s'] * 1e3:.0f} ms" if "median_s" in row[w] else f"{w} failed"
                for w in ways
            ),
            flush=True,
        )
    text = json.dumps(report, indent=1)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
