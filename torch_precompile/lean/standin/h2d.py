"""Host to device at the bus's speed: a mapped file's bytes through pinned buffers.

A copy from pageable memory (the mapped file) runs at about 6 GB/s: the driver
stages it through its own small pinned buffer, one piece at a time. Here the
bytes go through a few large pinned buffers in turn: while the device copies
one asynchronously, the host fills the next, so the bus (about 20 GB/s on
PCIe 5) and the host's memory copy overlap (AOTInductor loads its constants
the same way).

:func:`copy_checked` also checks what it copies: each worker takes a leaf of
the section's tree digest, copies it a piece at a time into its own pinned
buffers and hashes each piece there, while it is still in the cache, before
the device copies it; the mapped pages are read once, on every core.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ...file.treehash import TreeCheck, cores

__all__ = ["copy_checked", "copy_to_device"]

STAGE = 64 << 20  # bytes per pinned buffer
DEPTH = 3  # buffers in turn: one filling, the others in flight
MIN_STAGED = 2 * STAGE  # smaller copies gain nothing from staging


def copy_to_device(source: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A copy of the 1-D ``uint8`` CPU tensor ``source`` on ``device``, returned once
    it is complete (as ``source.to(device)`` from pageable memory is)."""
    target = torch.device(device)
    n = source.numel()
    if target.type != "cuda" or n < MIN_STAGED:
        return source.to(target)
    out = torch.empty(n, dtype=torch.uint8, device=target)
    buffers = [torch.empty(STAGE, dtype=torch.uint8, pin_memory=True) for _ in range(DEPTH)]
    done: list[torch.cuda.Event | None] = [None] * DEPTH
    stream = torch.cuda.current_stream(target)
    for i, start in enumerate(range(0, n, STAGE)):
        k, end = i % DEPTH, min(start + STAGE, n)
        if done[k] is not None:
            done[k].synchronize()  # the device has read this buffer: refill it
        staged = buffers[k][: end - start]
        staged.copy_(source[start:end])
        out[start:end].copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        done[k] = event
    stream.synchronize()  # as the pageable copy: usable on any stream once returned
    return out


PIECE = 4 << 20  # bytes staged and hashed at a time: within a core's share of the cache
SLOTS = 2  # pinned pieces per worker: one filling while the other is in flight
# Cores a GPU load leaves to its own thread and to the device's work beside it (the
# warm-up, the driver): on a 16-core H200 host 14 workers loaded a 3B-shaped file 5-8%
# sooner than 16, with the warm-up and without (docs/measurements.md).
LEFT = 2


def _workers(gpu: bool, leaves: int) -> int:
    """The copying and hashing threads: every core on the CPU, on a GPU all but
    :data:`LEFT` (on hosts of more than twice that), at most 16."""
    n = cores()
    if gpu and n > 2 * LEFT:
        n -= LEFT
    return max(1, min(n, 16, leaves))


def _bytes_at(address: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B")


def copy_checked(
    section: torch.Tensor, span: tuple[int, int], device: str | torch.device, check: TreeCheck
) -> torch.Tensor:
    """``section[span[0]:span[1]]`` (``section``: a 1-D ``uint8`` CPU tensor, the mapped
    section) on ``device``, with every leaf of ``section`` hashed into ``check`` from
    the bytes staged: pinned pieces for a GPU, the result itself for the CPU.

    Returned at once, the copies running on: nothing may read the result before
    ``check`` is asked whether the digest matches, which waits for them (and hashes
    the leaves it could not claim). A load builds its guards and loads its kernels
    meanwhile."""
    target = torch.device(device)
    lo, hi = span
    n, chunk = section.numel(), check.chunk
    out = torch.empty(hi - lo, dtype=torch.uint8, device=target)
    gpu = target.type == "cuda"
    workers = _workers(gpu, check.leaves)
    pinned = torch.empty(workers * SLOTS * PIECE if gpu else 0, dtype=torch.uint8, pin_memory=gpu)
    states: list[_Worker] = []  # one per pool thread (GPU copies only)
    local = threading.local()
    lock = threading.Lock()

    def worker() -> _Worker:
        state = getattr(local, "state", None)
        if state is None:
            with lock:
                state = _Worker(pinned, len(states), target)
                states.append(state)
            local.state = state
        return state

    def leaf(i: int) -> None:
        if not check.claim(i):
            return
        hasher = check.leaf_hasher()
        # Read through the tensors, so that the threads keep them (and their memory)
        # alive after this function returns, whatever the caller drops.
        src, dst = section.data_ptr(), out.data_ptr()
        for a in range(i * chunk, min(n, (i + 1) * chunk), PIECE):
            b = min(a + PIECE, (i + 1) * chunk, n)
            x0, x1 = max(a, lo), min(b, hi)  # the part of the piece that is copied
            if gpu:
                state = worker()
                staged = state.stage(src + a, b - a)
                hasher.update(_bytes_at(staged, b - a))
                if x0 < x1:
                    state.send(out[x0 - lo : x1 - lo], x0 - a, x1 - a)
            elif a == x0 and b == x1:  # wholly copied: hash it where it landed
                ctypes.memmove(dst + a - lo, src + a, b - a)
                hasher.update(_bytes_at(dst + a - lo, b - a))
            else:
                if x0 < x1:
                    ctypes.memmove(dst + x0 - lo, src + x0, x1 - x0)
                hasher.update(_bytes_at(src + a, b - a))
        check.put(i, hasher.digest())

    pool = ThreadPoolExecutor(workers, thread_name_prefix="torch_precompile-h2d")
    leaves = [pool.submit(leaf, i) for i in range(check.leaves)]

    def wait() -> None:
        try:
            for done in leaves:
                done.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for state in states:
                state.stream.synchronize()

    check.attach(wait)
    return out


class _Worker:
    """One worker's pinned pieces, their copies' events and its stream."""

    def __init__(self, pinned: torch.Tensor, index: int, device: torch.device) -> None:
        self.pieces = [pinned[(index * SLOTS + k) * PIECE :][:PIECE] for k in range(SLOTS)]
        self.done: list[torch.cuda.Event | None] = [None] * SLOTS
        self.stream = torch.cuda.Stream(device)
        torch.cuda.set_stream(self.stream)  # this thread's copies go on it
        self.turn = 0

    def stage(self, address: int, n: int) -> int:
        """Copy ``n`` bytes from ``address`` into the next free piece; its address."""
        k = self.turn % SLOTS
        if self.done[k] is not None:
            self.done[k].synchronize()  # the device has read this piece: refill it
        ctypes.memmove(self.pieces[k].data_ptr(), address, n)
        return self.pieces[k].data_ptr()

    def send(self, into: torch.Tensor, a: int, b: int) -> None:
        """Copy bytes ``a:b`` of the piece just staged into ``into`` on the device."""
        k = self.turn % SLOTS
        into.copy_(self.pieces[k][a:b], non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.done[k] = event
        self.turn += 1
