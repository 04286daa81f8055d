"""The artifact container: a checksummed, optionally signed bundle of byte sections.

Layout (all integers little-endian; docs/FORMAT.md has the byte table)::

    magic "TPCOMPL\\0" | u32 version | u32 flags | u64 header length | u64 file length
    | header JSON {"meta": {...}, "sections": [{name, offset, length, sha256}, ...]}
    | section bytes, back to back | [32-byte HMAC-SHA256 if flags bit 0] | 32-byte SHA-256

The HMAC covers everything before it; the final SHA-256 covers everything before
it, the HMAC included, so a flipped bit anywhere in the file is caught. Readers
validate the whole file before returning any of it. This module knows nothing
about torch and never unpickles: the sections are opaque bytes to it.

Three things hold for every format version, so that a reader can always tell a
corrupt file from a newer one: the magic at offset 0, the u32 version at
offset 8, and the SHA-256 of everything else in the last 32 bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import stat
import struct
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ._errors import (
    ArtifactCorruptedError,
    ArtifactVersionError,
    UntrustedArtifactError,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "ArtifactInfo",
    "looks_like_artifact",
    "read_artifact",
    "read_file",
    "read_info",
    "read_meta",
    "read_prefix",
    "write_artifact",
]

logger = logging.getLogger("torch_precompile")

MAGIC = b"TPCOMPL\x00"
FORMAT_VERSION = 1

# magic, version, flags, header length, total file length.
_FIXED = struct.Struct("<8sIIQQ")
_DIGEST_SIZE = 32  # SHA-256 and HMAC-SHA256 alike
_FLAG_SIGNED = 0x1
_KNOWN_FLAGS = _FLAG_SIGNED
_MIN_SIZE = _FIXED.size + _DIGEST_SIZE
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_REPAIR = "re-save the artifact or copy it again from its source"


@dataclasses.dataclass(frozen=True)
class ArtifactInfo:
    """What the header of a validated artifact says; no section bytes."""

    format_version: int
    signed: bool
    file_size: int
    meta: dict[str, Any]
    sections: tuple[dict[str, Any], ...]  # each {"name", "offset", "length", "sha256"}


# ---------------------------------------------------------------------- write


def write_artifact(
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    sections: Mapping[str, bytes],
    *,
    sign_key: bytes | str | None = None,
) -> int:
    """Atomically write ``meta`` and ``sections`` to ``path``; return the bytes written.

    ``meta`` must be JSON-serialisable (no NaN). Section values must be bytes-like.
    A ``str`` sign_key is encoded as UTF-8. Concurrent writers to one path are
    serialised through the lock file ``path + ".lock"``, which stays next to the
    target. An error or a kill at any point leaves the previous file as it was.
    """
    path = os.path.abspath(os.fspath(path))
    # Everything that can fail on bad arguments fails here, before the disk is touched.
    key = _as_key(sign_key, "sign_key")
    views = _section_views(sections)
    table = []
    offset = 0
    for name, view in views:
        table.append(
            {
                "name": name,
                "offset": offset,
                "length": view.nbytes,
                "sha256": hashlib.sha256(view).hexdigest(),
            }
        )
        offset += view.nbytes
    try:
        header = json.dumps(
            {"meta": dict(meta), "sections": table}, ensure_ascii=False, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as e:
        raise type(e)(f"artifact metadata for {path!r} is not JSON-serialisable: {e}") from e
    flags = _FLAG_SIGNED if key is not None else 0
    total = (
        _FIXED.size + len(header) + offset + (_DIGEST_SIZE if key is not None else 0) + _DIGEST_SIZE
    )
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, flags, len(header), total)

    from filelock import FileLock  # only writers need it; keeps `import torch_precompile` light

    start = time.perf_counter()
    with FileLock(path + ".lock"):
        _remove_stale_temps(path)
        _write_atomically(path, [fixed, header, *(view for _, view in views)], key, total)
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
    path: str, chunks: Iterable[bytes | memoryview], key: bytes | None, total: int
) -> None:
    tmp = _temp_name(path)
    # 0o666 lets the umask decide, as for any new file (mkstemp's 0o600 would not).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            digest = hashlib.sha256()
            mac = hmac.new(key, digestmod=hashlib.sha256) if key is not None else None
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
                if mac is not None:
                    mac.update(chunk)
            if mac is not None:
                signature = mac.digest()
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


# ----------------------------------------------------------------------- read


def looks_like_artifact(data_prefix: bytes) -> bool:
    """Whether ``data_prefix`` (the first bytes of a file) starts with our magic."""
    return bytes(data_prefix[: len(MAGIC)]) == MAGIC


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the caller's metadata of the artifact at ``path``, after validating the file.

    Checks magic, version, header and the whole-file SHA-256; returns no section
    bytes and runs nothing from the file, so it is safe on untrusted files.
    """
    return read_info(path).meta


def read_info(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Like :func:`read_meta`, plus format version, signature flag and section table.

    The file is checksummed in chunks: memory stays O(header) however large it is.
    """
    info, _ = _read(os.fspath(path), keep=False)
    return info


def read_artifact(
    path: str | os.PathLike[str], *, verify_key: bytes | str | None = None
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Return ``(meta, sections)`` of the artifact at ``path`` after validating all of it.

    With ``verify_key`` (``str`` is encoded as UTF-8) the file must carry a valid
    HMAC made with that key, else :class:`UntrustedArtifactError`; an unsigned
    file is refused from its fixed header, before the rest is read. Without it a
    signature in the file is not checked.
    """
    key = _as_key(verify_key, "verify_key")
    name = os.fspath(path)
    info, data = _read(name, verify_key=key, keep=True)
    assert data is not None
    data_start = _FIXED.size + _header_length(data)
    sections = {}
    for entry in info.sections:
        start = data_start + entry["offset"]
        section = data[start : start + entry["length"]]
        # Redundant with the whole-file checksum for accidents; catches a writer
        # bug or a hand-made file whose table points at the wrong bytes.
        if hashlib.sha256(section).hexdigest() != entry["sha256"]:
            raise _corrupted(name, f"section {entry['name']!r} fails its SHA-256 check")
        sections[entry["name"]] = bytes(section)
    return info.meta, sections


def read_prefix(path: str | os.PathLike[str], n: int) -> bytes:
    """The first ``n`` bytes (fewer if the file is shorter) of the regular file at ``path``."""
    with _open_regular(path) as f:
        return f.read(n)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """All bytes of the regular file at ``path`` (a pipe or device is refused, never read)."""
    with _open_regular(path) as f:
        return f.readall()


_CHUNK = 1 << 20  # checksummed this many bytes at a time
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _open_regular(path: str | os.PathLike[str]) -> io.FileIO:
    """Open ``path`` for reading if it is a regular file, without ever blocking.

    A named pipe would block ``open`` until a writer comes, and a device could
    be endless: the type is checked before opening, the open does not block
    (``O_NONBLOCK``), and the type is checked again on the descriptor (the path
    may have been swapped in between). A missing or unreadable file raises
    ``FileNotFoundError`` / ``PermissionError`` as for any file.
    """
    _check_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
    try:
        _check_regular(path, os.fstat(fd).st_mode)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _check_regular(path: str | os.PathLike[str], mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    what = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    raise _not_a_file(path, what)


def _not_a_file(path: str | os.PathLike[str], what: str) -> ArtifactCorruptedError:
    return ArtifactCorruptedError(
        f"{os.fspath(path)!r} is {what}, not a torch_precompile artifact: "
        "pass the path of an artifact file written by Precompile.save"
    )


def _corrupted(path: str, what: str) -> ArtifactCorruptedError:
    return ArtifactCorruptedError(f"artifact {path!r} is corrupted: {what}; {_REPAIR}")


def _trailer_size(signed: bool) -> int:
    return _DIGEST_SIZE * (2 if signed else 1)


def _header_length(fixed: bytes | bytearray | memoryview) -> int:
    return int(_FIXED.unpack_from(fixed)[3])


def _read_exactly(f: io.FileIO, path: str, offset: int, into: memoryview) -> None:
    f.seek(offset)
    done = 0
    while done < into.nbytes:
        n = f.readinto(into[done:])
        if not n:
            raise _corrupted(path, "the file became shorter while it was read")
        done += n


def _read(
    path: str, *, verify_key: bytes | None = None, keep: bool
) -> tuple[ArtifactInfo, bytes | None]:
    """Validate the file at ``path`` (all but the per-section checksums).

    Returns the header and, with ``keep``, the file's bytes. The fixed header
    decides first: not an artifact, truncated, or (with a ``verify_key``)
    unsigned are refused after reading 32 bytes. The rest is then checksummed
    in chunks, kept only with ``keep``. The order of the other checks matters:
    the checksum is verified before the version is believed (so a flipped
    version bit reads as corruption, not as a newer file), and the HMAC before
    the header JSON is parsed (so a forged header is never acted on).
    """
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        fixed = memoryview(bytearray(min(size, _FIXED.size)))
        _read_exactly(f, path, 0, fixed)
        if size < len(MAGIC) or not looks_like_artifact(fixed):
            what = (
                "the file is empty"
                if size == 0
                else "it does not start with the torch_precompile magic bytes"
            )
            raise ArtifactCorruptedError(
                f"{path!r} is not a torch_precompile artifact: {what}; "
                "pass a file written by Precompile.save, or re-save the artifact"
            )
        if size < _MIN_SIZE:
            raise _corrupted(
                path,
                f"the file is truncated ({size} bytes, a valid artifact has at least {_MIN_SIZE})",
            )
        _, version, flags, header_len, total = _FIXED.unpack_from(fixed)
        known = 1 <= version <= FORMAT_VERSION
        if known and total != size:
            raise _corrupted(
                path,
                f"the file has {size} bytes but its header says {total} (truncated or appended to)",
            )
        signed = bool(flags & _FLAG_SIGNED)
        if verify_key is not None and known and not signed and not flags & ~_KNOWN_FLAGS:
            raise UntrustedArtifactError(
                f"artifact {path!r} is not signed but a verify_key was given: "
                "re-save it with Precompile.save(..., sign_key=<the shared key>)"
            )
        # Where the HMAC (or, unsigned, the checksum) starts.
        payload_end = size - _trailer_size(signed)
        checked_end = size - _DIGEST_SIZE
        digest = hashlib.sha256()
        mac = hmac.new(verify_key, digestmod=hashlib.sha256) if verify_key is not None else None
        data: bytes | None = None
        if keep:  # one read, no zero-filled buffer: as fast as reading the file can be
            f.seek(0)
            data = f.read(size)
            if len(data) != size:
                raise _corrupted(path, "the file became shorter while it was read")
            whole = memoryview(data)
            for offset in range(0, checked_end, _CHUNK):
                view = whole[offset : min(offset + _CHUNK, checked_end)]
                digest.update(view)
                if mac is not None and offset < payload_end:
                    mac.update(view[: payload_end - offset])
            trailer = whole[checked_end:]
        else:  # one chunk in memory at a time
            chunk = memoryview(bytearray(max(min(_CHUNK, size), _DIGEST_SIZE)))
            for offset in range(0, checked_end, _CHUNK):
                view = chunk[: min(_CHUNK, checked_end - offset)]
                _read_exactly(f, path, offset, view)
                digest.update(view)
                if mac is not None and offset < payload_end:
                    mac.update(view[: payload_end - offset])
            trailer = chunk[:_DIGEST_SIZE]
            _read_exactly(f, path, checked_end, trailer)
        if not hmac.compare_digest(digest.digest(), trailer):
            raise _corrupted(
                path,
                "the SHA-256 checksum does not match (the file was truncated or altered)",
            )

        if version > FORMAT_VERSION:
            raise ArtifactVersionError(
                f"artifact {path!r} has format version {version}, this torch_precompile reads "
                f"versions up to {FORMAT_VERSION}: upgrade torch_precompile to load it"
            )
        if version < 1:
            raise _corrupted(path, f"invalid format version {version}")
        if flags & ~_KNOWN_FLAGS:
            raise _corrupted(path, f"unknown flags 0x{flags:x} for format version {version}")
        header_end = _FIXED.size + header_len
        if header_end > payload_end:
            raise _corrupted(path, f"header length {header_len} runs past the end of the file")

        if mac is not None:
            signature = memoryview(bytearray(_DIGEST_SIZE))
            _read_exactly(f, path, payload_end, signature)
            if not hmac.compare_digest(mac.digest(), signature):
                raise UntrustedArtifactError(
                    f"artifact {path!r} has a signature that does not match verify_key: it was "
                    "signed with another key or altered after signing; do not load it, re-save "
                    "it with the right sign_key"
                )

        if data is not None:
            raw = memoryview(data)[_FIXED.size : header_end]
        else:
            raw = memoryview(bytearray(header_len))
            _read_exactly(f, path, _FIXED.size, raw)
    header = _parse_header(path, raw)
    sections = _check_section_table(path, header["sections"], payload_end - header_end)
    info = ArtifactInfo(
        format_version=version,
        signed=signed,
        file_size=size,
        meta=header["meta"],
        sections=sections,
    )
    return info, data


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in header JSON")
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid in an artifact header")


def _parse_header(path: str, raw: memoryview) -> dict[str, Any]:
    try:
        header = json.loads(
            bytes(raw).decode("utf-8"),
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupted(path, f"the header is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise _corrupted(path, f"the header is a JSON {type(header).__name__}, not an object")
    if not isinstance(header.get("meta"), dict):
        raise _corrupted(path, "the header has no 'meta' object")
    if not isinstance(header.get("sections"), list):
        raise _corrupted(path, "the header has no 'sections' list")
    return header


def _check_section_table(path: str, table: list[Any], data_len: int) -> tuple[dict[str, Any], ...]:
    # Sections must tile the data region exactly, in order: no gaps, overlaps or
    # bytes outside any section, so there is one way to read a valid file.
    names = set()
    expected_offset = 0
    for i, entry in enumerate(table):
        if not isinstance(entry, dict):
            raise _corrupted(path, f"section entry {i} is not an object")
        name, offset, length, sha = (entry.get(k) for k in ("name", "offset", "length", "sha256"))
        if not isinstance(name, str) or name in names:
            raise _corrupted(path, f"section entry {i} has a missing or repeated name")
        names.add(name)
        # type() rather than isinstance: JSON true/false must not pass as 1/0.
        if type(offset) is not int or type(length) is not int or length < 0:
            raise _corrupted(path, f"section {name!r} has an invalid offset or length")
        if offset != expected_offset or offset + length > data_len:
            raise _corrupted(
                path,
                f"section {name!r} at offset {offset} with length {length} is out of bounds "
                f"(expected offset {expected_offset}, data region is {data_len} bytes)",
            )
        if not isinstance(sha, str) or _SHA256_HEX.fullmatch(sha) is None:
            raise _corrupted(path, f"section {name!r} has an invalid sha256")
        expected_offset += length
    if expected_offset != data_len:
        raise _corrupted(
            path,
            f"sections cover {expected_offset} bytes but the data region is {data_len} bytes",
        )
    return tuple(table)


def _as_key(key: bytes | str | None, what: str) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        key = bytes(key)
    else:
        raise TypeError(f"{what} must be bytes or str, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{what} must not be empty")
    return key
