"""Writing the container: validated arguments, one atomic replace, a lock per target.

See :mod:`.layout` for the bytes. The whole file is written to a temporary file
beside the target and renamed over it, so a reader sees the previous file or
the new one, never a part; writers of one path take turns through a lock file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from .layout import DIGEST_SIZE, FIXED, FLAG_SIGNED, FORMAT_VERSION, MAGIC, ZLIB, as_key
from .treehash import digest_entry

__all__ = ["write_artifact"]

logger = logging.getLogger("torch_precompile")


def write_artifact(
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    sections: Mapping[str, bytes],
    *,
    sign_key: bytes | str | None = None,
    compressed: Iterable[str] = (),
) -> int:
    """Atomically write ``meta`` and ``sections`` to ``path``; return the bytes written.

    ``meta`` must be JSON-serialisable (no NaN). Section values must be bytes-like.
    A ``str`` sign_key is encoded as UTF-8. Concurrent writers to one path are
    serialised through the lock file ``path + ".lock"``, which stays next to the
    target. An error or a kill at any point leaves the previous file as it was. The
    sections named in ``compressed`` are stored zlib-compressed (their SHA-256 is of the
    bytes stored).
    """
    path = os.path.abspath(os.fspath(path))
    # Everything that can fail on bad arguments fails here, before the disk is touched.
    key = as_key(sign_key, "sign_key")
    views = _section_views(sections)
    table = []
    offset = 0
    squeeze = set(compressed)
    for i, (name, view) in enumerate(views):
        extra: dict[str, Any] = {}
        if name in squeeze:
            extra = {"encoding": ZLIB, "size": view.nbytes}
            views[i] = (name, view := memoryview(zlib.compress(view, 6)))
        entry = {"name": name, "offset": offset, "length": view.nbytes, **extra}
        table.append(entry | digest_entry(view))
        offset += view.nbytes
    try:
        header = json.dumps(
            {"meta": dict(meta), "sections": table}, ensure_ascii=False, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as e:
        raise type(e)(f"artifact metadata for {path!r} is not JSON-serialisable: {e}") from e
    flags = FLAG_SIGNED if key is not None else 0
    signature = DIGEST_SIZE if key is not None else 0
    total = FIXED.size + DIGEST_SIZE + len(header) + offset + signature + DIGEST_SIZE
    fixed = FIXED.pack(MAGIC, FORMAT_VERSION, flags, len(header), total)
    # The header digest lets a reader trust the header (and through its section
    # table, each section) without reading the rest of the file.
    head = fixed + hashlib.sha256(header).digest() + header

    from filelock import FileLock  # only writers need it; keeps `import torch_precompile` light

    start = time.perf_counter()
    with FileLock(path + ".lock"):
        _remove_stale_temps(path)
        _write_atomically(path, head, [view for _, view in views], key, total)
    logger.debug(
        "wrote artifact %s: %d bytes, %d sections, signed=%s, %.3f s",
        path,
        total,
        len(views),
        key is not None,
        time.perf_counter() - start,
    )
    return total


def _section_views(sections: Mapping[str, bytes]) -> list[tuple[str, memoryview]]:
    views = []
    for name, value in sections.items():
        if not isinstance(name, str):
            raise TypeError(f"artifact section names must be str, got {type(name).__name__}")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"artifact section {name!r} must be bytes, got {type(value).__name__}")
        views.append((name, memoryview(value).cast("B")))
    return views


def _temp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.tmp-"


def _temp_name(path: str) -> str:
    # A leading dot hides it; pid and a random token make it unique and recognisable.
    return os.path.join(
        os.path.dirname(path),
        f"{_temp_prefix(path)}{os.getpid()}-{secrets.token_hex(8)}",
    )


def _is_temp_of(path: str, name: str) -> bool:
    # The exact shape matters: a looser match could take the temp of another target
    # (".a.tmp-x.tmp-1-..." belongs to "a.tmp-x", not to "a").
    return re.fullmatch(re.escape(_temp_prefix(path)) + r"\d+-[0-9a-f]{16}", name) is not None


def _remove_stale_temps(path: str) -> None:
    """Remove temp files of ``path`` left by killed writers.

    Called with the lock held: only lock holders create temps for ``path``, so
    every temp found now belongs to a writer that died before cleaning up.
    """
    directory = os.path.dirname(path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if _is_temp_of(path, name):
            try:
                os.unlink(os.path.join(directory, name))
                logger.info("removed stale temporary file %s left by an interrupted save", name)
            except FileNotFoundError:
                pass


def _write_atomically(
    path: str, head: bytes, sections: Iterable[memoryview], key: bytes | None, total: int
) -> None:
    """Write ``head`` (fixed fields, header digest, header), the sections, the HMAC of
    ``head`` (with a key) and the SHA-256 of all that, to a temp file renamed onto ``path``."""
    tmp = _temp_name(path)
    # 0o666 lets the umask decide, as for any new file (mkstemp's 0o600 would not).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            digest = hashlib.sha256(head)
            f.write(head)
            for chunk in sections:
                f.write(chunk)
                digest.update(chunk)
            if key is not None:
                signature = hmac.new(key, head, digestmod=hashlib.sha256).digest()
                f.write(signature)
                digest.update(signature)
            f.write(digest.digest())
            f.flush()
            # A bug here would otherwise surface only when the file is loaded.
            if f.tell() != total:
                raise AssertionError(f"wrote {f.tell()} bytes to {tmp}, expected {total}")
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(os.path.dirname(path))


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable; not every platform or filesystem allows it.
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError as e:
        logger.debug("could not fsync directory %s: %s", directory, e)
    finally:
        os.close(dfd)
