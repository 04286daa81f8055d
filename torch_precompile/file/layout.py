"""The container's byte layout and what reading and writing it share.

Layout of format version 2 (integers little-endian; docs/FORMAT.md has the tables)::

    magic "TPCOMPL\\0" | u32 version | u32 flags | u64 header length H | u64 file length N
    | SHA-256 of the header JSON | header JSON {"meta": {...}, "sections": [...]}
    | section bytes, back to back | [HMAC-SHA256 of bytes [0, 64 + H) if flags bit 0]
    | SHA-256 of bytes [0, N - 32)

The header names every section with its offset, length and SHA-256, so the
header digest (and the HMAC over the header) vouch for every byte: a reader can
check the header alone, decide from it, and then read only the sections it
needs. Version 1 had no header digest and its HMAC covered the sections too.

Three things hold for every format version, so that a reader can always tell a
corrupt file from a newer one: the magic at offset 0, the u32 version at
offset 8, and the SHA-256 of everything else in the last 32 bytes. This package
knows nothing about torch and never unpickles: sections are opaque bytes here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import stat
import struct
import zlib
from typing import Any

from .._errors import ArtifactCorruptedError
from .collector import no_cyclic_gc

__all__ = ["FORMAT_VERSION", "MAGIC", "ArtifactInfo", "looks_like_artifact"]

MAGIC = b"TPCOMPL\x00"
FORMAT_VERSION = 4
# What this reader still reads: version 1 files load as they did.
OLDEST_VERSION = 1
# From this version on the header alone vouches for every section (its digest).
HEADER_ONLY_FROM = 3
# A section stored compressed says so in its table entry ("encoding", and "size" its
# bytes once decoded), from version 4: the compiled and lean pickles, mostly source text.
ZLIB = "zlib"

# magic, version, flags, header length, total file length.
FIXED = struct.Struct("<8sIIQQ")
DIGEST_SIZE = 32  # SHA-256 and HMAC-SHA256 alike
FLAG_SIGNED = 0x1
KNOWN_FLAGS = FLAG_SIGNED
MIN_SIZE = FIXED.size + DIGEST_SIZE
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
REPAIR = "re-save the artifact or copy it again from its source"


def fixed_size(version: int) -> int:
    """Bytes before the header JSON: the fixed fields, and from version 2 the header digest."""
    return FIXED.size if version == 1 else FIXED.size + DIGEST_SIZE


def trailer_size(signed: bool) -> int:
    return DIGEST_SIZE * (2 if signed else 1)


@dataclasses.dataclass(frozen=True)
class ArtifactInfo:
    """What the header of a validated artifact says; no section bytes."""

    format_version: int
    signed: bool
    file_size: int
    meta: dict[str, Any]
    sections: tuple[dict[str, Any], ...]  # each {"name", "offset", "length", "sha256"}
    data_start: int = 0  # file offset of the first section

    def section(self, name: str) -> dict[str, Any] | None:
        """The table entry of section ``name``, or None."""
        return next((s for s in self.sections if s["name"] == name), None)


def decoded(path: str, entry: dict[str, Any], stored: bytes | memoryview) -> bytes:
    """A section's bytes from what the file stores (checked against its SHA-256 before)."""
    encoding = entry.get("encoding")
    if encoding is None:
        return bytes(stored)
    if encoding != ZLIB:
        raise corrupted(path, f"section {entry['name']!r} has an unknown encoding {encoding!r}")
    try:
        data = zlib.decompress(stored)
    except zlib.error as e:
        raise corrupted(path, f"section {entry['name']!r} does not decompress ({e})") from None
    if len(data) != entry.get("size"):
        raise corrupted(path, f"section {entry['name']!r} decompresses to the wrong size")
    return data


def looks_like_artifact(data_prefix: bytes) -> bool:
    """Whether ``data_prefix`` (the first bytes of a file) starts with our magic."""
    return bytes(data_prefix[: len(MAGIC)]) == MAGIC


# What torch's own save_compiled_function writes first: a pickle up to torch 2.14, its
# ``PT2AOT`` magic (then a format version byte and the pickle) from 2.15.
_TORCH_COMPILED_FILE_STARTS = (b"\x80", b"PT2AOT")


def looks_like_torch_compiled_file(data_prefix: bytes) -> bool:
    """Whether ``data_prefix`` (at least 6 bytes of a file) starts as a file of torch's
    ``save_compiled_function`` does."""
    return bytes(data_prefix[:6]).startswith(_TORCH_COMPILED_FILE_STARTS)


def torch_compiled_pickle(data: bytes | memoryview) -> bytes:
    """The pickle inside what torch's ``save_compiled_function`` writes: the bytes
    themselves up to 2.14, after the ``PT2AOT`` magic and its version byte from 2.15."""
    data = bytes(data)
    magic = _TORCH_COMPILED_FILE_STARTS[1]
    return data[len(magic) + 1 :] if data.startswith(magic) else data


def as_key(key: bytes | str | None, what: str) -> bytes | None:
    """A signing key as bytes (``str`` is encoded as UTF-8); None stays None."""
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


def corrupted(path: str, what: str) -> ArtifactCorruptedError:
    return ArtifactCorruptedError(f"artifact {path!r} is corrupted: {what}; {REPAIR}")


# ------------------------------------------------------------ regular files

O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: str | os.PathLike[str]) -> io.FileIO:
    """Open ``path`` for reading if it is a regular file, without ever blocking.

    A named pipe would block ``open`` until a writer comes, and a device could
    be endless: the type is checked before opening, the open does not block
    (``O_NONBLOCK``), and the type is checked again on the descriptor (the path
    may have been swapped in between). A missing or unreadable file raises
    ``FileNotFoundError`` / ``PermissionError`` as for any file.
    """
    _check_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | O_NONBLOCK | O_CLOEXEC)
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
    raise ArtifactCorruptedError(
        f"{os.fspath(path)!r} is {what}, not a torch_precompile artifact: "
        "pass the path of an artifact file written by Precompile.save"
    )


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in header JSON")
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid in an artifact header")


def parse_header(path: str, raw: memoryview) -> dict[str, Any]:
    """The header's JSON, checked to be an object with ``meta`` and ``sections``."""
    # No cyclic GC while parsing: a finalizer it ran at a deep header's recursion
    # limit (another reader's file close) would fail there, as an unraisable error.
    try:
        with no_cyclic_gc():
            header = json.loads(
                bytes(raw).decode("utf-8"),
                object_pairs_hook=_reject_duplicates,
                parse_constant=_reject_constant,
            )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise corrupted(path, f"the header is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise corrupted(path, f"the header is a JSON {type(header).__name__}, not an object")
    if not isinstance(header.get("meta"), dict):
        raise corrupted(path, "the header has no 'meta' object")
    if not isinstance(header.get("sections"), list):
        raise corrupted(path, "the header has no 'sections' list")
    return header
