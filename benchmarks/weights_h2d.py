"""How weights should reach the GPU at load: four ways from a file, fresh processes.

Each way reads a block of ``--sizes`` MiB from a file (in the page cache: the
file was just written, as a served model's file is after its first start) and
leaves it on ``cuda:0``; the time runs from after CUDA's context exists to a
synchronised copy, with the host memory each way allocates.

- ``pageable``: read the bytes into ordinary memory, one copy to the GPU (what
  ``torch_precompile`` did before this benchmark);
- ``pinned``: read into page-locked memory of the whole size, one copy;
- ``mapped``: ``torch.from_file`` (a private mapping), one copy;
- ``staged``: two page-locked 64 MiB buffers; reading one chunk overlaps the
  copy of the previous one.

Usage (a CUDA machine)::

    python benchmarks/weights_h2d.py --sizes 256,1024 --repeats 3 --out report.json
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

WAYS = ("pageable", "pinned", "mapped", "staged")

CHILD = r"""
import ctypes, json, sys, time
import torch
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
check = int(out[:: max(1, n // 4096)].sum().item())
print(json.dumps({"s": elapsed, "check": check}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024", help="MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
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
            f.write(os.urandom(n))
        row: dict = {}
        checks = set()
        for way in WAYS:
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
                for w in WAYS
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
