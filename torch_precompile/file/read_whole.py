"""Reading the container whole: :func:`read_artifact`, :func:`read_info` and
:func:`read_meta` check the whole file (its SHA-256, and with a key its HMAC) before
returning anything; :mod:`.reader` reads the header first and sections on demand,
with the checks defined here. Reads and checksums are recorded for
:mod:`torch_precompile._trace`. Nothing here unpickles; see :mod:`.layout` for the
bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import time
from typing import Any

from .._errors import ArtifactCorruptedError, ArtifactVersionError, UntrustedArtifactError
from . import trace as _trace
from .layout import (
    DIGEST_SIZE,
    FIXED,
    FLAG_SIGNED,
    FORMAT_VERSION,
    KNOWN_FLAGS,
    MAGIC,
    MIN_SIZE,
    OLDEST_VERSION,
    SHA256_HEX,
    ArtifactInfo,
    as_key,
    corrupted,
    decoded,
    fixed_size,
    looks_like_artifact,
    open_regular,
    parse_header,
    trailer_size,
)
from .treehash import MIN_CHUNK, entry_matches

__all__ = [
    "read_artifact",
    "read_file",
    "read_info",
    "read_meta",
    "read_prefix",
]

_CHUNK = 1 << 20  # checksummed this many bytes at a time
WHOLE_FILE = "<whole file>"  # the name a whole-file checksum is recorded under (_trace)


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
    key = as_key(verify_key, "verify_key")
    name = os.fspath(path)
    info, data = _read(name, verify_key=key, keep=True)
    assert data is not None
    sections = {}
    for entry in info.sections:
        start = info.data_start + entry["offset"]
        stored = _checked(name, entry, data[start : start + entry["length"]])
        sections[entry["name"]] = decoded(name, entry, stored)
    return info.meta, sections


def read_prefix(path: str | os.PathLike[str], n: int) -> bytes:
    """The first ``n`` bytes (fewer if the file is shorter) of the regular file at ``path``."""
    with open_regular(path) as f:
        return f.read(n)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """All bytes of the regular file at ``path`` (a pipe or device is refused, never read)."""
    with open_regular(path) as f:
        return f.readall()


# ------------------------------------------------------------ header first


# ------------------------------------------------------------- whole file


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
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        fixed = _read_fixed(f, path, size, verify_key)
        return _read_open(f, path, size, fixed, verify_key=verify_key, keep=keep)


def _read_fixed(f: io.FileIO, path: str, size: int, verify_key: bytes | None) -> tuple[Any, ...]:
    """The fixed fields, after the checks they allow alone (magic, size, signed flag)."""
    fixed = memoryview(bytearray(min(size, FIXED.size)))
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
    if size < MIN_SIZE:
        raise corrupted(
            path, f"the file is truncated ({size} bytes, a valid artifact has at least {MIN_SIZE})"
        )
    values = FIXED.unpack_from(fixed)
    _, version, flags, _, total = values
    known = OLDEST_VERSION <= version <= FORMAT_VERSION
    if known and total != size:
        raise corrupted(
            path,
            f"the file has {size} bytes but its header says {total} (truncated or appended to)",
        )
    if verify_key is not None and known and not flags & FLAG_SIGNED and not flags & ~KNOWN_FLAGS:
        raise UntrustedArtifactError(
            f"artifact {path!r} is not signed but a verify_key was given: "
            "re-save it with Precompile.save(..., sign_key=<the shared key>)"
        )
    return values


def _read_open(
    f: io.FileIO,
    path: str,
    size: int,
    fixed: tuple[Any, ...],
    *,
    verify_key: bytes | None,
    keep: bool,
) -> tuple[ArtifactInfo, bytes | None]:
    _, version, flags, header_len, _ = fixed
    signed = bool(flags & FLAG_SIGNED)
    # Where the HMAC (or, unsigned, the checksum) starts, and where the HMAC's input ends.
    payload_end = size - trailer_size(signed)
    checked_end = size - DIGEST_SIZE
    header_end = fixed_size(version) + header_len
    mac_end = payload_end if version == 1 else min(header_end, payload_end)
    began, digest = time.perf_counter(), hashlib.sha256()
    mac = hmac.new(verify_key, digestmod=hashlib.sha256) if verify_key is not None else None
    data: bytes | None = None
    if keep:  # one read, no zero-filled buffer: as fast as reading the file can be
        f.seek(0)
        data = f.read(size)
        if len(data) != size:
            raise corrupted(path, "the file became shorter while it was read")
        whole = memoryview(data)
        for offset in range(0, checked_end, _CHUNK):
            view = whole[offset : min(offset + _CHUNK, checked_end)]
            digest.update(view)
            if mac is not None and offset < mac_end:
                mac.update(view[: mac_end - offset])
        trailer = whole[checked_end:]
    else:  # one chunk in memory at a time
        chunk = memoryview(bytearray(max(min(_CHUNK, size), DIGEST_SIZE)))
        for offset in range(0, checked_end, _CHUNK):
            view = chunk[: min(_CHUNK, checked_end - offset)]
            _read_exactly(f, path, offset, view)
            digest.update(view)
            if mac is not None and offset < mac_end:
                mac.update(view[: mac_end - offset])
        trailer = chunk[:DIGEST_SIZE]
        _read_exactly(f, path, checked_end, trailer)
    _trace.record("hash", WHOLE_FILE, checked_end, time.perf_counter() - began)
    if not hmac.compare_digest(digest.digest(), trailer):
        raise corrupted(
            path, "the SHA-256 checksum does not match (the file was truncated or altered)"
        )

    if version > FORMAT_VERSION:
        raise ArtifactVersionError(
            f"artifact {path!r} has format version {version}, this torch_precompile reads "
            f"versions up to {FORMAT_VERSION}: upgrade torch_precompile to load it"
        )
    if version < OLDEST_VERSION:
        raise corrupted(path, f"invalid format version {version}")
    if flags & ~KNOWN_FLAGS:
        raise corrupted(path, f"unknown flags 0x{flags:x} for format version {version}")
    if header_end > payload_end:
        raise corrupted(path, f"header length {header_len} runs past the end of the file")
    if mac is not None:
        _check_signature(f, path, mac, payload_end)

    if data is not None:
        head = memoryview(data)[:header_end]
    else:
        head = memoryview(bytearray(header_end))
        _read_exactly(f, path, 0, head)
    raw = head[fixed_size(version) :]
    # Redundant with the whole-file checksum for accidents; one definition of a good header.
    if version > 1 and hashlib.sha256(raw).digest() != head[FIXED.size : fixed_size(version)]:
        raise corrupted(path, "the header fails its SHA-256 check (the file was altered)")
    return _info(path, version, signed, size, raw, header_end, payload_end), data


def _check_signature(f: io.FileIO, path: str, mac: Any, payload_end: int) -> None:
    signature = memoryview(bytearray(DIGEST_SIZE))
    _read_exactly(f, path, payload_end, signature)
    if not hmac.compare_digest(mac.digest(), signature):
        raise UntrustedArtifactError(
            f"artifact {path!r} has a signature that does not match verify_key: it was "
            "signed with another key or altered after signing; do not load it, re-save "
            "it with the right sign_key"
        )


def _read_exactly(f: io.FileIO, path: str, offset: int, into: memoryview) -> None:
    f.seek(offset)
    done = 0
    while done < into.nbytes:
        n = f.readinto(into[done:])
        if not n:
            raise corrupted(path, "the file became shorter while it was read")
        done += n


def _verify(path: str, entry: dict[str, Any], section: bytes | memoryview) -> None:
    # Redundant with the whole-file checksum for accidents; catches a writer bug or
    # a hand-made file whose table points at the wrong bytes, and is the only
    # check of a section read after the header alone.
    if not _hash_matches(entry["name"], entry, section):
        raise corrupted(path, f"section {entry['name']!r} fails its SHA-256 check")


def _hash_matches(name: str, entry: dict[str, Any], section: bytes | memoryview) -> bool:
    began = time.perf_counter()
    ok = entry_matches(entry, section)
    _trace.record("hash", name, len(section), time.perf_counter() - began)
    return ok


def _checked(path: str, entry: dict[str, Any], section: bytes | memoryview) -> bytes:
    _verify(path, entry, section)
    return bytes(section)


# ------------------------------------------------------------------ header


def _info(
    path: str,
    version: int,
    signed: bool,
    size: int,
    raw: memoryview,
    header_end: int,
    payload_end: int,
) -> ArtifactInfo:
    header = parse_header(path, raw)
    sections = _check_section_table(path, header["sections"], payload_end - header_end)
    return ArtifactInfo(
        format_version=version,
        signed=signed,
        file_size=size,
        meta=header["meta"],
        sections=sections,
        data_start=header_end,
    )


def _check_section_table(path: str, table: list[Any], data_len: int) -> tuple[dict[str, Any], ...]:
    # Sections must tile the data region exactly, in order: no gaps, overlaps or
    # bytes outside any section, so there is one way to read a valid file.
    names = set()
    expected_offset = 0
    for i, entry in enumerate(table):
        if not isinstance(entry, dict):
            raise corrupted(path, f"section entry {i} is not an object")
        name, offset, length = (entry.get(k) for k in ("name", "offset", "length"))
        if not isinstance(name, str) or name in names:
            raise corrupted(path, f"section entry {i} has a missing or repeated name")
        names.add(name)
        # type() rather than isinstance: JSON true/false must not pass as 1/0.
        if type(offset) is not int or type(length) is not int or length < 0:
            raise corrupted(path, f"section {name!r} has an invalid offset or length")
        if offset != expected_offset or offset + length > data_len:
            raise corrupted(
                path,
                f"section {name!r} at offset {offset} with length {length} is out of bounds "
                f"(expected offset {expected_offset}, data region is {data_len} bytes)",
            )
        _check_digest_fields(path, name, entry)
        expected_offset += length
    if expected_offset != data_len:
        raise corrupted(
            path,
            f"sections cover {expected_offset} bytes but the data region is {data_len} bytes",
        )
    return tuple(table)


def _check_digest_fields(path: str, name: str, entry: dict[str, Any]) -> None:
    """Exactly one digest: ``sha256`` (the whole section) or ``sha256_tree`` with its
    ``tree_chunk`` (docs/FORMAT.md)."""
    tree, plain = "sha256_tree" in entry, "sha256" in entry
    sha = entry.get("sha256_tree" if tree else "sha256")
    if tree == plain or not isinstance(sha, str) or SHA256_HEX.fullmatch(sha) is None:
        raise corrupted(path, f"section {name!r} has an invalid sha256")
    chunk = entry.get("tree_chunk")
    if tree and (type(chunk) is not int or chunk < MIN_CHUNK):
        raise corrupted(path, f"section {name!r} has an invalid tree_chunk {chunk!r}")
