"""Python's cyclic garbage collector held off while a file is read and rebuilt."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """No automatic cyclic collection inside the block; cycles made there are collected
    by the next collection after it.

    A load makes tens of thousands of long-lived objects (guard trees, their code, a
    stand-in's modules); every few hundred allocations the collector ran, and each
    full pass walked all of them (40% of a small generator's load on a CPU). A
    header parsed at the recursion limit also must not run a finaliser. Nested and
    concurrent blocks keep the collector off until the last one leaves; one the
    caller had disabled stays disabled.
    """
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
