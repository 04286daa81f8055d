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

A section copied out at load is hashed by its copier, leaf by leaf from the
bytes just staged (:class:`TreeCheck`), so the file's pages are read once.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = [
    "CHUNK",
    "MIN_CHUNK",
    "MIN_TREE",
    "TreeCheck",
    "cores",
    "digest_entry",
    "entry_matches",
    "tree_sha256",
]

MIN_CHUNK = 1 << 12  # a reader refuses smaller leaves (a hand-made table of tiny ones)
CHUNK = 16 << 20  # bytes per leaf: large enough that a thread's start is noise
MIN_TREE = 64 << 20  # smaller sections keep the plain SHA-256 (one chunk gains nothing)
_DOMAIN = b"torch_precompile sha256-tree"


def cores() -> int:
    """The cores this process may run on (at most 32): the hashing threads."""
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def tree_sha256(data: bytes | bytearray | memoryview, chunk: int = CHUNK) -> str:
    """The hex ``sha256-tree`` digest of ``data`` over ``chunk``-byte leaves, hashed on
    all cores."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    view = memoryview(data).cast("B")
    n = view.nbytes
    starts = range(0, n, chunk) if n else range(1)

    def leaf(start: int) -> bytes:
        return hashlib.sha256(view[start : start + chunk]).digest()

    return _root(chunk, n, _on_all_cores(leaf, starts))


def _on_all_cores(leaf: Callable[[int], bytes], starts: range | list[int]) -> list[bytes]:
    workers = min(cores(), len(starts))
    if workers <= 1:
        return [leaf(s) for s in starts]
    with ThreadPoolExecutor(workers, thread_name_prefix="torch_precompile-tree") as pool:
        return list(pool.map(leaf, starts))


def _root(chunk: int, n: int, leaves: list[bytes]) -> str:
    root = hashlib.sha256(_DOMAIN + struct.pack("<QQ", chunk, n))
    for digest in leaves:
        root.update(digest)
    return root.hexdigest()


class TreeCheck:
    """A section's ``sha256-tree`` digest computed by whoever copies the section out.

    The copier takes leaves (``chunk`` bytes each, the last shorter) with
    :meth:`claim`, feeds each one's bytes in order to a :meth:`leaf_hasher` as it
    stages them, and hands the digest to :meth:`put`, from any thread; a copier
    that runs on after it returns :meth:`attach`-es its wait. :meth:`matches`
    waits for the copiers, hashes the leaves nobody put from ``view`` itself (a
    copier that stopped early, or none) and compares the root with the one recorded.
    """

    def __init__(self, view: memoryview, chunk: int, expected: str) -> None:
        self.view, self.chunk, self._expected = view, chunk, expected
        self.leaves = max(1, -(-view.nbytes // chunk))
        self._digests: list[bytes | None] = [None] * self.leaves
        self._claimed = [False] * self.leaves
        self._lock = threading.Lock()
        self._copiers: list[Callable[[], None]] = []

    def claim(self, index: int) -> bool:
        """Whether the caller now owns leaf ``index`` (False: another copier has it)."""
        with self._lock:
            if self._claimed[index]:
                return False
            self._claimed[index] = True
            return True

    @staticmethod
    def leaf_hasher() -> Any:
        """A fresh hash object for one leaf's bytes."""
        return hashlib.sha256()

    def attach(self, wait: Callable[[], None]) -> None:
        """A copier still running: ``wait()`` returns once its copies are complete."""
        self._copiers.append(wait)

    def wait(self) -> None:
        """Wait for the copiers attached (re-raising what failed in one)."""
        while self._copiers:
            self._copiers.pop()()

    def put(self, index: int, digest: bytes) -> None:
        """Leaf ``index``'s digest, from the hasher that saw all its bytes in order."""
        self._digests[index] = digest

    def matches(self) -> bool:
        """Whether the section's digest is the recorded one."""
        return self.digest() == self._expected

    def digest(self) -> str:
        """The section's hex digest, once the copiers are done (the leaves nobody put
        are hashed here)."""
        self.wait()
        missing = [i for i, d in enumerate(self._digests) if d is None]
        view, chunk = self.view, self.chunk

        def leaf(i: int) -> bytes:
            return hashlib.sha256(view[i * chunk : (i + 1) * chunk]).digest()

        for i, digest in zip(missing, _on_all_cores(leaf, missing)):
            self._digests[i] = digest
        return _root(chunk, view.nbytes, self._digests)  # type: ignore[arg-type]


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
