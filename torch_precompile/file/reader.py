"""Reading sections on demand: :func:`open_artifact` checks the fixed fields and the
header (its digest, and with a key its HMAC) and returns an :class:`ArtifactReader`
that maps the file once and hands out each section checked against its SHA-256 the
first time it is used (the safetensors habit): a caller decides from the header and
reads only what it needs, once. A section copied out at once (the weights) is
checked as it is copied (:meth:`ArtifactReader.view_to_copy`): by the copier, leaf
by leaf, where it has a tree digest; else on a thread meanwhile."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import io
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from . import trace as _trace
from .layout import (
    FIXED,
    FLAG_SIGNED,
    FORMAT_VERSION,
    HEADER_ONLY_FROM,
    KNOWN_FLAGS,
    ArtifactInfo,
    corrupted,
    decoded,
    fixed_size,
    open_regular,
    trailer_size,
)
from .read_whole import (
    _check_signature,
    _hash_matches,
    _info,
    _read_exactly,
    _read_fixed,
    _read_open,
    _verify,
)
from .treehash import TreeCheck

__all__ = ["ArtifactReader", "open_artifact"]


class ArtifactReader:
    """An open artifact whose header was checked; sections are read on demand.

    The file is mapped once; each section is checked against its SHA-256 when
    first used and kept by name, so each is read and checked at most once. As
    with any mapped file (``safetensors``), a file cut short in place while
    mapped ends the process (SIGBUS); ``Precompile.save`` renames a new file,
    never writes in place. After :meth:`settle` the mapping is gone but the
    file stays open (until the reader is collected): a section asked for then
    (``compiled``, to save a lean-loaded artifact again) is read from the
    bytes loaded, even if the path was removed or replaced since, and checked.
    """

    def __init__(self, path: str, f: io.FileIO, info: ArtifactInfo) -> None:
        self.path = path
        self.info = info
        self._f: io.FileIO | None = f
        self._map: mmap.mmap | None = None
        self._mapping = True
        self._views: dict[str, memoryview] = {}
        self._lock = threading.Lock()
        self._checking: dict[str, Callable[[], bool]] = {}  # each check's verdict, waited for
        self._forget_after_check: set[str] = set()
        weakref.finalize(self, f.close)

    def __enter__(self) -> ArtifactReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def settle(self) -> None:
        """Drop the mapping and the views (held views keep it); later reads read the file."""
        self._join()
        with self._lock:
            self._mapping = False
            self._views.clear()
            if self._map is not None:
                with contextlib.suppress(BufferError):  # a view is still held
                    self._map.close()
                self._map = None

    def close(self) -> None:
        """Drop the mapping and close the file."""
        self.settle()
        if self._f is not None:
            self._f.close()
            self._f = None

    def names(self) -> list[str]:
        """The section names, in file order."""
        return [s["name"] for s in self.info.sections]

    def view(self, name: str) -> memoryview:
        """Section ``name``, checked (once while mapped), as a read-only view; ``KeyError``."""
        with self._lock:
            found = self._views.get(name)
            if found is None:
                found = self._checked_view(name)
                if self._mapping:
                    self._views[name] = found
            return found

    def view_to_copy(self, name: str) -> tuple[memoryview, TreeCheck | None]:
        """Section ``name`` as a read-only view of the mapped file, to be copied out at
        once, and checked meanwhile: with a tree digest, by the copier, from the
        :class:`~.treehash.TreeCheck` returned (leaves it leaves out are hashed by
        :meth:`finish`); else on a thread (``hashlib`` lets go of the GIL), and None.
        :meth:`finish` raises if the check failed; nothing read through this view may
        be handed out before it returns."""
        with self._lock:
            found = self._views.get(name)
            if found is not None or not self._mapping:
                return (found if found is not None else self._checked_view(name)), None
            entry, view = self._entry(name), self._mapped_view(name)
            self._views[name] = view
            if "sha256_tree" in entry:
                check = TreeCheck(view, int(entry["tree_chunk"]), entry["sha256_tree"])
                self._checking[name] = functools.partial(self._timed, name, check)
                return view, check
            verdict: list[bool] = []
            thread = threading.Thread(
                target=lambda: verdict.append(_hash_matches(name, entry, view)),
                name=f"torch_precompile-sha256-{name}",
                daemon=True,
            )
            thread.start()
            self._checking[name] = lambda: thread.join() or verdict == [True]
            return view, None

    @staticmethod
    def _timed(name: str, check: TreeCheck) -> bool:
        began = time.perf_counter()
        ok = check.matches()
        _trace.record("hash", name, check.view.nbytes, time.perf_counter() - began)
        return ok

    def finish(self) -> None:
        """Wait for the checks :meth:`view_to_copy` started; ``ArtifactCorruptedError``
        for a section that failed. Then the sections forgotten meanwhile are dropped."""
        failed = self._join()
        if failed:
            raise corrupted(self.path, f"section {failed[0]!r} fails its SHA-256 check")
        for name in sorted(self._forget_after_check):
            self.forget(name)
        self._forget_after_check.clear()

    def _join(self) -> list[str]:
        """Wait for every check on a thread; the names of the sections that failed."""
        with self._lock:
            checking, self._checking = self._checking, {}
        return [name for name, verdict in checking.items() if not verdict()]

    def read(self, name: str) -> bytes:
        """The bytes of section ``name`` (a copy of :meth:`view`, decompressed where the
        file stores it so); ``KeyError`` if there is none."""
        return decoded(self.path, self._entry(name), self.view(name))

    def forget(self, name: str) -> None:
        """Drop the view of ``name`` once used (the weights, copied out at load):
        its pages leave this process's resident memory."""
        with self._lock:
            if name in self._checking:  # its check still reads the pages
                self._forget_after_check.add(name)
                return
            view = self._views.pop(name, None)
            entry = self.info.section(name)
            if view is None or entry is None or self._map is None:
                return
            with contextlib.suppress(BufferError):  # still exported: dropped when unused
                view.release()
            start = self.info.data_start + entry["offset"]
            first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            end = (start + entry["length"]) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > first and hasattr(mmap, "MADV_DONTNEED"):
                self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.info.section(name)
        if entry is None:
            raise KeyError(name)
        if self._f is None:
            raise ValueError(f"the reader of {self.path!r} is closed")
        return entry

    def _mapped_view(self, name: str) -> memoryview:
        entry = self._entry(name)
        assert self._f is not None
        start, length = self.info.data_start + entry["offset"], entry["length"]
        began = time.perf_counter()
        if self._map is None:
            self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._map) < start + length:
            raise corrupted(self.path, "the file became shorter while it was read")
        view = memoryview(self._map)[start : start + length]
        _trace.record("read", name, length, time.perf_counter() - began)
        return view

    def _checked_view(self, name: str) -> memoryview:
        entry = self._entry(name)
        if self._mapping:
            view = self._mapped_view(name)
        else:
            assert self._f is not None
            start, length = self.info.data_start + entry["offset"], entry["length"]
            began = time.perf_counter()
            view = memoryview(bytearray(length))
            _read_exactly(self._f, self.path, start, view)
            _trace.record("read", name, length, time.perf_counter() - began)
        _verify(self.path, entry, view)
        return view


def open_artifact(
    path: str | os.PathLike[str],
    *,
    verify_key: bytes | None = None,
    opened: io.FileIO | None = None,
) -> ArtifactReader:
    """Open the artifact at ``path`` and check its header; read sections later.

    For a current file this reads the fixed fields and the header only: the
    header's SHA-256 (and, with ``verify_key``, the HMAC that covers it) is
    checked, and the header pins each section's SHA-256, checked as it is read.
    A file of another version is checked whole first, as :func:`read_info` does.
    The same errors as :func:`read_artifact`, in the same cases. ``opened``: the
    file, already opened by :func:`open_regular` (the reader owns it from here).
    ``verify_key`` is bytes: a text key is encoded once, by ``Precompile.load``.
    """
    if verify_key is not None and not isinstance(verify_key, bytes):
        raise TypeError(f"verify_key must be bytes here, got {type(verify_key).__name__}")
    key = verify_key
    name = os.fspath(path)
    began = time.perf_counter()
    f = opened if opened is not None else open_regular(name)
    try:
        size = os.fstat(f.fileno()).st_size
        fixed = _read_fixed(f, name, size, key)
        version = fixed[1]
        if HEADER_ONLY_FROM <= version <= FORMAT_VERSION:
            info = _read_header_only(f, name, size, fixed, key)
        else:  # older or unknown: no header digest to trust, check the whole file
            info, _ = _read_open(f, name, size, fixed, verify_key=key, keep=False)
        _trace.record("header", "header", info.data_start, time.perf_counter() - began)
        return ArtifactReader(name, f, info)
    except BaseException:
        f.close()
        raise


def _read_header_only(
    f: io.FileIO, path: str, size: int, fixed: tuple[Any, ...], key: bytes | None
) -> ArtifactInfo:
    _, version, flags, header_len, _ = fixed
    if flags & ~KNOWN_FLAGS:
        raise corrupted(path, f"unknown flags 0x{flags:x} for format version {version}")
    signed = bool(flags & FLAG_SIGNED)
    payload_end = size - trailer_size(signed)
    header_end = fixed_size(version) + header_len
    if header_end > payload_end:
        raise corrupted(path, f"header length {header_len} runs past the end of the file")
    head = memoryview(bytearray(header_end))
    _read_exactly(f, path, 0, head)
    raw = head[fixed_size(version) :]
    if not hmac.compare_digest(
        hashlib.sha256(raw).digest(), head[FIXED.size : fixed_size(version)]
    ):
        raise corrupted(path, "the header fails its SHA-256 check (the file was altered)")
    if key is not None:
        _check_signature(f, path, hmac.new(key, head, digestmod=hashlib.sha256), payload_end)
    return _info(path, version, signed, size, raw, header_end, payload_end)
