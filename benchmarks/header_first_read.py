"""What reading an artifact's header costs, whole-file check against header first.

Writes a container with one large section (default 512 MiB, random bytes) and
a small one, signed, then times (median of 5, file in the page cache):
``read_info`` (what inspect runs: the whole-file SHA-256 and HMAC), and
``open_artifact`` with the key (header digest and HMAC over the header), alone
and then reading the small section or every section.

    python benchmarks/header_first_read.py [MiB]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from torch_precompile import file as container


def _median(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    key = b"bench-key"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.tpc")
        big = os.urandom(mib << 20)
        container.write_artifact(
            path, {"m": 1}, {"weights": big, "small": b"x" * 100}, sign_key=key
        )
        del big

        def header_first(names: tuple[str, ...]) -> None:
            with container.open_artifact(path, verify_key=key) as reader:
                for name in names or ():
                    reader.read(name)

        rows = {
            "read_info (whole-file SHA-256)": lambda: container.read_info(path),
            "read_artifact(verify_key) (whole file, all sections)": lambda: container.read_artifact(
                path, verify_key=key
            ),
            "open_artifact(verify_key): header only": lambda: header_first(()),
            "open_artifact(verify_key) + read('small')": lambda: header_first(("small",)),
            "open_artifact(verify_key) + read every section": lambda: header_first(
                ("weights", "small")
            ),
        }
        print(f"file: {mib} MiB section + 100 B section, signed; median of 5")
        for name, fn in rows.items():
            print(f"| {name} | {_median(fn) * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
