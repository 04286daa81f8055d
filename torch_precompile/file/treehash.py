"""A SHA-256 tree over fixed-size chunks: a section's digest hashed on every core.

One SHA-256 runs at about 2 GB/s on one thread, so checking a 16 GB section of
weights that way costs 8 s; the chunks of a tree are hashed side by side
(``hashlib`` lets go of the GIL), so the check runs at the speed of memory. The
digest (a section's ``sha256_tree``, beside its ``tree_chunk``; docs/FORMAT.md) is

    SHA-256(b"torch_precompile sha256-tree" | u64 chunk | u64 length
            | SHA-256(chunk 0) | SHA-256(chunk 1) | ...)

with the integers little-endian and the last chunk possibly shorter. The
chunk size and the length are hashed in, so no two layouts of one input share
a digest, and a changed byte anywhere changes its chunk's leaf and so the root.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["CHUNK", "MIN_CHUNK", "MIN_TREE", "digest_entry", "entry_matches", "tree_sha256"]

MIN_CHUNK = 1 << 12  # a reader refuses smaller leaves (a hand-made table of tiny ones)
CHUNK = 16 << 20  # bytes per leaf: large enough that a thread's start is noise
MIN_TREE = 64 << 20  # smaller sections keep the plain SHA-256 (one chunk gains nothing)
_DOMAIN = b"torch_precompile sha256-tree"


def _workers() -> int:
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def tree_sha256(
    data: bytes | bytearray | memoryview,
    chunk: int = CHUNK,
    *,
    on_chunk: Callable[[int, int], None] | None = None,
) -> str:
    """The hex ``sha256-tree`` digest of ``data`` over ``chunk``-byte leaves.

    ``on_chunk(start, end)`` is called (from a worker thread) after each leaf is
    hashed, for callers that overlap work with the check; leaves are hashed on
    all cores, in no particular order.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    view = memoryview(data).cast("B")
    n = view.nbytes
    starts = range(0, n, chunk) if n else range(1)

    def leaf(start: int) -> bytes:
        digest = hashlib.sha256(view[start : start + chunk]).digest()
        if on_chunk is not None:
            on_chunk(start, min(start + chunk, n))
        return digest

    workers = min(_workers(), len(starts))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="torch_precompile-tree") as pool:
            leaves = list(pool.map(leaf, starts))
    else:
        leaves = [leaf(s) for s in starts]
    root = hashlib.sha256(_DOMAIN + struct.pack("<QQ", chunk, n))
    for digest in leaves:
        root.update(digest)
    return root.hexdigest()


def digest_entry(view: memoryview) -> dict[str, str | int]:
    """The digest fields of a section's table entry: ``sha256`` for a small section,
    ``sha256_tree`` and ``tree_chunk`` from :data:`MIN_TREE` bytes up."""
    if view.nbytes >= MIN_TREE:
        return {"sha256_tree": tree_sha256(view, CHUNK), "tree_chunk": CHUNK}
    return {"sha256": hashlib.sha256(view).hexdigest()}


def entry_matches(entry: dict[str, object], section: bytes | memoryview) -> bool:
    """Whether ``section`` has the digest its (already validated) table entry records."""
    tree = entry.get("sha256_tree")
    if tree is not None:
        return tree_sha256(section, int(entry["tree_chunk"])) == tree  # type: ignore[call-overload]
    return hashlib.sha256(section).hexdigest() == entry["sha256"]
