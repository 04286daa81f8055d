"""What a generator build tells as it runs, and the options that make its file serve at
any thread count."""

from __future__ import annotations

import dataclasses
import time
from typing import Any


def program_name(batch: int, length: int, max_batch: int, dynamic: bool) -> str:
    """What one compiled variant serves, in words: ``decode, batch 2..8``."""
    what = "prefill" if length > 1 else "decode"
    rows = ("batch 2.." + (str(max_batch) if max_batch > 1 else "")) if dynamic else "batch 1"
    return f"{what}, {rows}"


@dataclasses.dataclass(frozen=True)
class BuildProgress:
    """Where a build is, as its log record carries it (``extra={"progress": ...}``): a
    handler (the CLI's ``cli/progress.py``) may show it on one updating line."""

    program: str
    n: int
    of: int
    began: float  # time.perf_counter() at the build's start

    def __str__(self) -> str:
        elapsed = time.perf_counter() - self.began
        return f"{self.program} ({self.n} of {self.of}), {elapsed:.0f} s elapsed"


def thread_free_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` with Inductor's C++ kernels built to read the thread count when they
    run (``cpp.dynamic_threads``: OpenMP's team size and each reduction's per-thread
    buffers sized at run time), unless ``options`` says otherwise. The file then serves
    at any ``torch.set_num_threads`` (its global-state guard leaves the count out,
    ``lean_writer/guard_leaves.py``). GPU kernels are unchanged by it."""
    return {"cpp.dynamic_threads": True, **(options or {})}
