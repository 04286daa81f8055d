"""Tests of the artifact container (torch_precompile.file) and the system check (_system).

No compilation happens here. Subprocesses import ``torch_precompile.file``
without running the package ``__init__`` (which imports torch), so that spawning
one costs tens of milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import random
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from torch_precompile import file as container
from torch_precompile._errors import (
    ArtifactCorruptedError,
    ArtifactVersionError,
    IncompatibleSystemError,
    PrecompileError,
    UntrustedArtifactError,
)
from torch_precompile.file import (
    FORMAT_VERSION,
    MAGIC,
    looks_like_artifact,
    open_artifact,
    read_artifact,
    read_info,
    read_meta,
    write_artifact,
)
from torch_precompile.file import read_whole as file_read
from torch_precompile.runtime import machine as _system

PKG_DIR = str(Path(container.__file__).resolve().parent.parent)
# Makes `from torch_precompile import file` work in a child without the package __init__.
BOOTSTRAP = f"""
import sys, types
_pkg = types.ModuleType("torch_precompile")
_pkg.__path__ = [{PKG_DIR!r}]
sys.modules["torch_precompile"] = _pkg
from torch_precompile import file as container
"""

FIXED = struct.Struct("<8sIIQQ")


def _sections(rng: random.Random | None = None) -> dict[str, bytes]:
    rng = rng or random.Random(0)
    return {
        "code": b"def f(x):\n    return x + 1\n",
        "empty": b"",
        "weights": rng.randbytes(1 << 20),
        "tail": bytes(range(256)),
    }


META = {
    "torch": "2.13.0",
    "guards": ["L['x'].size()[0] == 3"],
    "created": 1.5,
    "nested": {"ü": [1, None, True]},
}


def _temps(directory: Path, target: str) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(f".{target}.tmp-")]


def _reseal(data: bytes, *, fix_total: bool = True) -> bytes:
    """Recompute the total length, the header digest and the trailing SHA-256, as an
    attacker could."""
    body = bytearray(data[:-32])
    if fix_total:
        struct.pack_into("<Q", body, 24, len(body) + 32)
    (_, _, _, hlen, _) = FIXED.unpack_from(body)
    body[32:64] = hashlib.sha256(body[64 : 64 + hlen]).digest()
    return bytes(body) + hashlib.sha256(body).digest()


def _build(
    header: bytes,
    payload: bytes = b"",
    *,
    version: int = FORMAT_VERSION,
    flags: int = 0,
    header_len=None,
) -> bytes:
    """A file with arbitrary header bytes and valid checksums (unsigned); version 1 has
    no header digest."""
    hlen = len(header) if header_len is None else header_len
    digest = b"" if version == 1 else hashlib.sha256(header).digest()
    total = FIXED.size + len(digest) + len(header) + len(payload) + 32
    body = FIXED.pack(MAGIC, version, flags, hlen, total) + digest + header + payload
    return body + hashlib.sha256(body).digest()


def _header(sections: list[dict], meta=None) -> bytes:
    return json.dumps({"meta": meta if meta is not None else {}, "sections": sections}).encode()


def _entry(name: str, offset: int, data: bytes, length=None) -> dict:
    n = len(data) if length is None else length
    return {
        "name": name,
        "offset": offset,
        "length": n,
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _expect_corrupted(path: Path, *, key: bytes | None = None) -> str:
    with pytest.raises(ArtifactCorruptedError) as excinfo:
        read_artifact(path, verify_key=key)
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message
    return message


# ------------------------------------------------------------------ round trip


@pytest.mark.parametrize("key", [None, b"secret", "clé partagée"])
def test_round_trip(tmp_path: Path, key) -> None:
    path = tmp_path / "model.tpc"
    sections = _sections()
    written = write_artifact(path, META, sections, sign_key=key)
    assert written == path.stat().st_size
    assert path.read_bytes().startswith(MAGIC)

    meta, got = read_artifact(path, verify_key=key)
    assert meta == META
    assert got == sections
    assert list(got) == list(sections)  # order kept
    assert all(type(v) is bytes for v in got.values())
    assert read_meta(path) == META  # no key needed for metadata, signed or not

    info = read_info(path)
    assert info.format_version == FORMAT_VERSION
    assert info.signed is (key is not None)
    assert info.file_size == written
    assert [(s["name"], s["length"]) for s in info.sections] == [
        (k, len(v)) for k, v in sections.items()
    ]


def test_round_trip_accepts_bytes_like_and_overwrites(tmp_path: Path) -> None:
    path = str(tmp_path / "a.tpc")
    write_artifact(path, {"v": 1}, {"a": b"old"})
    write_artifact(path, {"v": 2}, {"a": bytearray(b"new"), "b": memoryview(b"xyz"), "c": b""})
    assert read_artifact(path) == ({"v": 2}, {"a": b"new", "b": b"xyz", "c": b""})
    write_artifact(path, {}, {})
    assert read_artifact(path) == ({}, {})
    assert _temps(tmp_path, "a.tpc") == []
    assert os.path.exists(path + ".lock")  # the lock file lives beside the target


def test_looks_like_artifact(tmp_path: Path) -> None:
    path = tmp_path / "a.tpc"
    write_artifact(path, {}, {"a": b"1"})
    assert looks_like_artifact(path.read_bytes()[:16])
    assert looks_like_artifact(MAGIC)
    for prefix in (
        b"",
        b"TPCOMPL",
        b"PK\x03\x04" + bytes(12),
        b"\x80\x02}q\x00",
        b"hello world",
    ):
        assert not looks_like_artifact(prefix)


# -------------------------------------------------------------- not artifacts


def _not_artifacts(tmp_path: Path) -> dict[str, Path]:
    import torch

    files = {}

    def put(name: str, data: bytes) -> None:
        files[name] = tmp_path / name
        files[name].write_bytes(data)

    put("empty", b"")
    rng = random.Random(1)
    for n in (1, 7, 8, 31, 63, 64, 100, 10_000):
        put(f"random{n}", rng.randbytes(n))
    put("magic_only", MAGIC)
    put("magic_then_random", MAGIC + rng.randbytes(500))
    put("magic_then_zeros", MAGIC + bytes(100))
    put("text", b"this is a text file\nnot an artifact\n")
    torch.save({"w": torch.arange(4.0)}, tmp_path / "torch_save")
    files["torch_save"] = tmp_path / "torch_save"
    with zipfile.ZipFile(tmp_path / "plain_zip", "w") as z:
        z.writestr("a.txt", "hello")
    files["plain_zip"] = tmp_path / "plain_zip"
    return files


def test_not_artifacts_are_corrupted(tmp_path: Path) -> None:
    for name, path in _not_artifacts(tmp_path).items():
        for read in (
            read_meta,
            read_artifact,
            lambda p: read_artifact(p, verify_key=b"k"),
        ):
            with pytest.raises(ArtifactCorruptedError) as excinfo:
                read(path)
            message = str(excinfo.value)
            assert str(path) in message and "\n" not in message, name
            assert "re-save" in message, name
        assert looks_like_artifact(path.read_bytes()[:8]) is name.startswith("magic"), name


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactCorruptedError, match="is a directory"):
        read_artifact(tmp_path)
    with pytest.raises(ArtifactCorruptedError, match="is a directory"):
        read_meta(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_artifact(tmp_path / "missing.tpc")
    with pytest.raises(FileNotFoundError):
        read_meta(tmp_path / "missing.tpc")


def test_appended_bytes_are_corrupted(tmp_path: Path) -> None:
    path = tmp_path / "a.tpc"
    write_artifact(path, META, {"a": b"abc"})
    path.write_bytes(path.read_bytes() + b"\x00")
    assert "truncated or appended" in _expect_corrupted(path)


# ------------------------------------------------------------------ truncation


def test_truncation_anywhere(tmp_path: Path) -> None:
    path = tmp_path / "a.tpc"
    sections = {"a": b"A" * 300, "empty": b"", "b": b"B" * 200, "c": b"C" * 100}
    write_artifact(path, META, sections, sign_key=b"k")
    data = path.read_bytes()
    size = len(data)
    (_, _, _, hlen, _) = FIXED.unpack_from(data)
    data_start = FIXED.size + 32 + hlen
    cuts = {
        3,  # inside the magic
        10,  # inside the version
        20,  # inside the header length
        30,  # inside the total length
        FIXED.size + 16,  # inside the header digest
        FIXED.size + 32 + hlen // 2,  # inside the header JSON
        data_start,  # header complete, no sections
        data_start + 150,  # inside section a
        data_start + 300,  # end of a / the empty section
        data_start + 400,  # inside section b
        data_start + 550,  # inside section c
        size - 64,  # sections complete, no HMAC
        size - 50,  # inside the HMAC
        size - 32,  # no checksum
        size - 16,  # inside the checksum
        size - 1,
        1,
    }
    assert len(cuts) == 17
    for cut in sorted(cuts):
        truncated = tmp_path / f"cut{cut}.tpc"
        truncated.write_bytes(data[:cut])
        _expect_corrupted(truncated)
        _expect_corrupted(truncated, key=b"k")
        with pytest.raises(ArtifactCorruptedError):
            read_meta(truncated)


# ------------------------------------------------------------------- bit flips

_FLIP_READER = (
    BOOTSTRAP
    + """
import json
from torch_precompile import _errors
key = b"flip-key"
modes = {
    "meta": lambda p: container.read_meta(p),
    "plain": lambda p: container.read_artifact(p),
    "verified": lambda p: container.read_artifact(p, verify_key=key),
}
for line in sys.stdin:
    path, mode_names = json.loads(line)
    for mode in mode_names:
        try:
            modes[mode](path)
            outcome = "RETURNED"
        except _errors.PrecompileError as e:
            outcome = type(e).__name__
        except BaseException as e:
            outcome = f"{type(e).__name__}: {e}"
        print(json.dumps([path, mode, outcome]), flush=True)
"""
)


def test_bit_flips_are_always_caught(tmp_path: Path) -> None:
    rng = random.Random(1234)
    sections = {
        "code": rng.randbytes(700),
        "empty": b"",
        "weights": rng.randbytes(1500),
    }
    originals = {}
    for signed in (False, True):
        path = tmp_path / f"orig_{signed}.tpc"
        write_artifact(path, META, sections, sign_key=b"flip-key" if signed else None)
        originals[signed] = path.read_bytes()

    jobs = []
    for i in range(200):
        signed = i % 2 == 1
        data = bytearray(originals[signed])
        # The first flips hit each fixed field and both ends on purpose; the rest are random.
        fixed_positions = [
            0,
            8,
            12,
            16,
            24,
            40,
            len(data) - 64,
            len(data) - 33,
            len(data) - 1,
        ]
        pos = fixed_positions[i // 2] if i // 2 < len(fixed_positions) else rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        flipped = tmp_path / f"flip{i:03d}.tpc"
        flipped.write_bytes(bytes(data))
        modes = ["meta", "plain", "verified"] if signed else ["meta", "plain"]
        jobs.append((str(flipped), modes))

    proc = subprocess.run(
        [sys.executable, "-c", _FLIP_READER],
        check=False,
        input="".join(json.dumps(job) + "\n" for job in jobs),
        capture_output=True,
        text=True,
        timeout=60,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, (
        f"reader died after {len(results)} reads: rc={proc.returncode} {proc.stderr[-2000:]}"
    )
    assert len(results) == sum(len(m) for _, m in jobs)
    allowed = {
        "meta": {"ArtifactCorruptedError"},
        "plain": {"ArtifactCorruptedError"},
        "verified": {"ArtifactCorruptedError", "UntrustedArtifactError"},
    }
    bad = [r for r in results if r[2] not in allowed[r[1]]]
    assert not bad, bad[:10]


# ------------------------------------------------------- hand-made bad headers


def _bad_files() -> dict[str, bytes]:
    a, b = b"A" * 10, b"B" * 5
    good = [_entry("a", 0, a), _entry("b", 10, b)]
    return {
        "not_json": _build(b"{not json", a + b),
        "not_utf8": _build(b'{"meta": "\xff"}', a + b),
        "nan": _build(b'{"meta": {"x": NaN}, "sections": []}'),
        "list": _build(b"[]"),
        "string": _build(b'"header"'),
        "deep": _build(b"[" * 100_000 + b"]" * 100_000),
        "no_meta": _build(json.dumps({"sections": good}).encode(), a + b),
        "meta_not_dict": _build(json.dumps({"meta": [1], "sections": good}).encode(), a + b),
        "no_sections": _build(json.dumps({"meta": {}}).encode(), a + b),
        "duplicate_keys": _build(b'{"meta": {}, "meta": {}, "sections": []}'),
        "entry_not_dict": _build(_header([1])),
        "offset_out_of_bounds": _build(_header([_entry("a", 100, a)]), a),
        "length_out_of_bounds": _build(_header([_entry("a", 0, a, length=11)]), a),
        "huge_length": _build(_header([_entry("a", 0, a, length=2**62)]), a),
        "negative_length": _build(_header([_entry("a", 0, a, length=-1)]), a),
        "bool_length": _build(_header([_entry("a", 0, b"x", length=True)]), b"x"),
        "float_offset": _build(_header([{**_entry("a", 0, a), "offset": 0.0}]), a),
        "gap": _build(_header([_entry("a", 0, a), _entry("b", 11, b)]), a + b"x" + b),
        "overlap": _build(_header([_entry("a", 0, a), _entry("b", 5, b)]), a),
        "uncovered_bytes": _build(_header(good), a + b + b"extra"),
        "duplicate_names": _build(_header([_entry("a", 0, a), _entry("a", 10, b)]), a + b),
        "bad_sha_hex": _build(_header([{**_entry("a", 0, a), "sha256": "zz"}]), a),
        "wrong_section_sha": _build(_header([_entry("a", 0, b"not a")]), a),
        "header_len_too_big": _build(_header([]), header_len=10**6),
        "unknown_flags": _build(_header([]), flags=0x80),
        "version_zero": _build(_header([]), version=0),
        "wrong_total": _build(_header([]))[:24] + struct.pack("<Q", 5) + _build(_header([]))[32:],
    }


def test_bad_headers_are_corrupted(tmp_path: Path) -> None:
    for name, data in _bad_files().items():
        path = tmp_path / f"{name}.tpc"
        path.write_bytes(data)
        message = _expect_corrupted(path)
        assert "re-save" in message, name
        if name != "wrong_section_sha":  # per-section checksums are checked by read_artifact only
            with pytest.raises(ArtifactCorruptedError):
                read_meta(path)


def test_headers_parse_with_the_cyclic_collector_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection while a deeply nested header is parsed would run other objects'
    finalizers (a dropped reader's file close) at the recursion limit, where they
    fail as unraisable errors: the collector is paused while parsing, then back on,
    also when the header is refused."""
    import gc

    from torch_precompile.file import layout

    enabled_while_parsing = []

    class _Json:
        def loads(self, *args: object, **kwargs: object) -> object:
            enabled_while_parsing.append(gc.isenabled())
            return json.loads(*args, **kwargs)

    monkeypatch.setattr(layout, "json", _Json())
    good, deep = tmp_path / "good.tpc", tmp_path / "deep.tpc"
    write_artifact(good, META, {"a": b"x"})
    deep.write_bytes(_bad_files()["deep"])
    assert read_meta(good) == META
    _expect_corrupted(deep)
    assert enabled_while_parsing == [False, False] and gc.isenabled()


def test_newer_version(tmp_path: Path) -> None:
    path = tmp_path / "a.tpc"
    write_artifact(path, META, {"a": b"x"})
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    path.write_bytes(_reseal(bytes(data)))
    for read in (read_meta, read_artifact):
        with pytest.raises(ArtifactVersionError) as excinfo:
            read(path)
        message = str(excinfo.value)
        assert f"version {FORMAT_VERSION + 1}" in message
        assert f"up to {FORMAT_VERSION}" in message and "upgrade torch_precompile" in message

    # Without a matching checksum, a large version is a flipped bit, not a newer file.
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 2**31 + 1)
    path.write_bytes(bytes(data))
    _expect_corrupted(path)


def _version_1(meta: dict, sections: dict[str, bytes], key: bytes | None = None) -> bytes:
    """A format-version-1 file: no header digest; its HMAC covers the sections too."""
    table, offset = [], 0
    for name, data in sections.items():
        table.append(_entry(name, offset, data))
        offset += len(data)
    header = _header(table, meta)
    payload = b"".join(sections.values())
    total = FIXED.size + len(header) + len(payload) + (32 if key else 0) + 32
    body = FIXED.pack(MAGIC, 1, 1 if key else 0, len(header), total) + header + payload
    if key:
        body += hmac.new(key, body, hashlib.sha256).digest()
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize("key", [None, b"k1"])
def test_version_1_files_still_read(tmp_path: Path, key) -> None:
    """The previous layout (no header digest, HMAC over the sections) reads as it did,
    whole or header first (which then checks the whole file, having no header digest)."""
    path = tmp_path / "v1.tpc"
    sections = _sections()
    path.write_bytes(_version_1(META, sections, key))
    assert read_artifact(path, verify_key=key) == (META, sections)
    info = read_info(path)
    assert info.format_version == 1 and info.signed is (key is not None)
    with open_artifact(path, verify_key=key) as reader:
        assert reader.info.format_version == 1
        assert {n: reader.read(n) for n in reader.names()} == sections
    if key:
        with pytest.raises(UntrustedArtifactError):
            read_artifact(path, verify_key=b"another key")
        with pytest.raises(UntrustedArtifactError):
            open_artifact(path, verify_key=b"another key")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # in the sections: only the whole-file checksum sees it
    path.write_bytes(bytes(data))
    _expect_corrupted(path)
    with pytest.raises(ArtifactCorruptedError):
        open_artifact(path)


# ---------------------------------------------------------------- header first


def test_header_first_reads_only_the_header_and_the_asked_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open_artifact reads the fixed fields and the header; read(name) reads that section."""
    path = tmp_path / "big.tpc"
    big = random.Random(3).randbytes(8 << 20)
    write_artifact(path, META, {"big": big, "small": b"tiny", "empty": b""}, sign_key=b"k")
    read_bytes = []
    real = file_read._read_exactly

    def counting(f, p, offset, into):
        read_bytes.append(into.nbytes)
        return real(f, p, offset, into)

    monkeypatch.setattr(file_read, "_read_exactly", counting)
    with open_artifact(path, verify_key=b"k") as reader:
        assert reader.info.meta == META and reader.names() == ["big", "small", "empty"]
        assert sum(read_bytes) < 4096  # fixed fields, header, HMAC: not the 8 MiB section
        assert reader.read("small") == b"tiny" and reader.read("empty") == b""
        assert sum(read_bytes) < 4096
        assert reader.read("big") == big
        with pytest.raises(KeyError):
            reader.read("missing")


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_header_first_never_returns_altered_bytes(tmp_path: Path, signed: bool) -> None:
    """Flip each bit position of a small file once: the header-first reader raises, or
    returns exactly the original sections (a flip in the trailing checksum, which it does
    not need, or, unsigned, nowhere else)."""
    key = b"flip-key" if signed else None
    sections = {"code": b"print(1)" * 20, "empty": b"", "weights": bytes(range(200))}
    path = tmp_path / "orig.tpc"
    write_artifact(path, META, sections, sign_key=key)
    original = path.read_bytes()
    rng = random.Random(5)
    flipped = tmp_path / "flipped.tpc"
    returned = []
    for pos in range(len(original)):
        data = bytearray(original)
        data[pos] ^= 1 << rng.randrange(8)
        flipped.write_bytes(bytes(data))
        try:
            with open_artifact(flipped, verify_key=key) as reader:
                got = {n: reader.read(n) for n in reader.names()}
                meta = reader.info.meta
        except (ArtifactCorruptedError, UntrustedArtifactError):
            continue
        assert (meta, got) == (META, sections), pos
        returned.append(pos)
    # Only the trailing checksum is not read (a flip there is harmless to what is returned).
    assert returned == list(range(len(original) - 32, len(original)))


def test_header_first_checks_the_signature(tmp_path: Path) -> None:
    signed, unsigned = tmp_path / "s.tpc", tmp_path / "u.tpc"
    write_artifact(signed, {"role": "user"}, {"code": b"ok"}, sign_key=b"k")
    write_artifact(unsigned, {"role": "user"}, {"code": b"ok"})
    with open_artifact(signed, verify_key=b"k") as reader:
        assert reader.read("code") == b"ok"
    with pytest.raises(UntrustedArtifactError, match="does not match"):
        open_artifact(signed, verify_key=b"another key")
    with pytest.raises(UntrustedArtifactError, match="not signed"):
        open_artifact(unsigned, verify_key=b"k")
    # Header edited and every digest recomputed: only the HMAC (over the header) catches it.
    tampered = tmp_path / "t.tpc"
    tampered.write_bytes(_reseal(signed.read_bytes().replace(b"user", b"root")))
    with open_artifact(tampered) as reader:
        assert reader.info.meta == {"role": "root"}
    with pytest.raises(UntrustedArtifactError):
        open_artifact(tampered, verify_key=b"k")


# --------------------------------------------------------------------- signing


def test_signing(tmp_path: Path) -> None:
    signed = tmp_path / "signed.tpc"
    unsigned = tmp_path / "unsigned.tpc"
    sections = {"a": b"payload", "b": b""}
    write_artifact(signed, META, sections, sign_key="clé")
    write_artifact(unsigned, META, sections)

    assert read_artifact(signed, verify_key="clé".encode()) == (
        META,
        sections,
    )  # str key == its UTF-8
    assert read_artifact(signed) == (META, sections)  # no key: signature not checked
    assert read_meta(signed) == META and read_meta(unsigned) == META

    with pytest.raises(UntrustedArtifactError, match="not signed"):
        read_artifact(unsigned, verify_key=b"k")
    with pytest.raises(UntrustedArtifactError, match="does not match"):
        read_artifact(signed, verify_key=b"another key")
    with pytest.raises(ValueError):
        write_artifact(tmp_path / "x.tpc", {}, {}, sign_key=b"")
    with pytest.raises(TypeError):
        read_artifact(signed, verify_key=123)


def test_tampered_signed_file_never_returns_data(tmp_path: Path) -> None:
    path = tmp_path / "signed.tpc"
    write_artifact(path, {"role": "user"}, {"code": b"print('hi')"}, sign_key=b"k")
    data = path.read_bytes()
    tampered = tmp_path / "tampered.tpc"

    # Careless tampering: checksum left stale.
    tampered.write_bytes(data.replace(b"user", b"root"))
    with pytest.raises((ArtifactCorruptedError, UntrustedArtifactError)):
        read_artifact(tampered, verify_key=b"k")

    # Careful tampering: header edited and every checksum recomputed; only the HMAC catches it.
    tampered.write_bytes(_reseal(data.replace(b"user", b"root")))
    assert read_meta(tampered) == {"role": "root"}
    with pytest.raises(UntrustedArtifactError):
        read_artifact(tampered, verify_key=b"k")

    # Signature stripped: flag cleared, HMAC removed, checksum recomputed.
    body = bytearray(data[:-64])
    struct.pack_into("<I", body, 12, 0)
    tampered.write_bytes(_reseal(bytes(body) + bytes(32)))
    assert read_artifact(tampered)[0] == {"role": "user"}
    with pytest.raises(UntrustedArtifactError, match="not signed"):
        read_artifact(tampered, verify_key=b"k")

    # Re-signed by someone else.
    write_artifact(tampered, {"role": "root"}, {"code": b"evil"}, sign_key=b"attacker")
    with pytest.raises(UntrustedArtifactError):
        read_artifact(tampered, verify_key=b"k")


# ------------------------------------------------------------ failures mid-save


def test_failed_save_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.tpc"
    write_artifact(path, {"v": 1}, {"a": b"old"})
    before = path.read_bytes()

    with pytest.raises(TypeError, match="'b' must be bytes"):
        write_artifact(path, {"v": 2}, {"a": b"new", "b": "not bytes"})
    with pytest.raises(TypeError, match="JSON"):
        write_artifact(path, {"v": object()}, {"a": b"new"})
    with pytest.raises(ValueError, match="JSON"):
        write_artifact(path, {"v": float("nan")}, {"a": b"new"})
    assert path.read_bytes() == before and _temps(tmp_path, "a.tpc") == []

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    for target in ("replace", "fsync"):
        with monkeypatch.context() as m:
            m.setattr(os, target, boom)
            with pytest.raises(OSError, match="disk on fire"):
                write_artifact(path, {"v": 2}, {"a": b"new" * 1000})
        assert path.read_bytes() == before, target
        assert _temps(tmp_path, "a.tpc") == [], target

    with monkeypatch.context() as m:
        m.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            write_artifact(path, {"v": 2}, {"a": b"new"})
    assert path.read_bytes() == before and _temps(tmp_path, "a.tpc") == []
    assert read_artifact(path) == ({"v": 1}, {"a": b"old"})


def test_stale_temps_removed_but_not_other_targets(tmp_path: Path) -> None:
    path = tmp_path / "a.tpc"
    stale = [
        tmp_path / ".a.tpc.tmp-999999-0123456789abcdef",
        tmp_path / f".a.tpc.tmp-{os.getpid()}-fedcba9876543210",
    ]
    others = [
        tmp_path / ".a.tpc.tmp-x.tmp-1-0123456789abcdef",  # temp of the target "a.tpc.tmp-x"
        tmp_path / ".b.tpc.tmp-1-0123456789abcdef",
        tmp_path / ".a.tpc.tmp-1-0123456789abcdef.keep",
        tmp_path / "a.tpc.tmp-1-0123456789abcdef",
    ]
    for p in stale + others:
        p.write_bytes(b"partial")
    write_artifact(path, {}, {"a": b"1"})
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in others)


# --------------------------------------------------------------- crash safety

_LOOP_WRITER = (
    BOOTSTRAP
    + """
import hashlib
path, writer, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print("ready", flush=True)
sys.stdin.readline()  # wait for "go"
n = 0
while count < 0 or n < count:
    payload = hashlib.sha256(f"{writer}-{n}".encode()).digest() * (size // 32)
    meta = {"writer": writer, "n": n, "sha256": hashlib.sha256(payload).hexdigest()}
    container.write_artifact(path, meta, {"payload": payload, "small": b"%d" % n})
    n += 1
"""
)


def _spawn_writer(
    path: Path, writer: int, size: int, count: int = -1, *, start: bool = True
) -> subprocess.Popen:
    """Start a writer subprocess and wait until it is ready; ``start`` also says "go"."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LOOP_WRITER,
            str(path),
            str(writer),
            str(size),
            str(count),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    if start:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return proc


def _check_complete(path: Path) -> tuple[int, int]:
    meta, sections = read_artifact(path)
    assert hashlib.sha256(sections["payload"]).hexdigest() == meta["sha256"]
    assert sections["small"] == b"%d" % meta["n"]
    return meta["writer"], meta["n"]


def test_sigkill_mid_save_never_tears_the_file(tmp_path: Path) -> None:
    path = tmp_path / "art.tpc"
    rng = random.Random(7)
    seen = set()
    stale_seen = 0
    for i in range(20):
        proc = _spawn_writer(path, i, 4 << 20)
        if i % 2:
            # Kill while this writer's own temp file exists: mid-write for sure.
            deadline = time.monotonic() + 10
            while not any(f"-{proc.pid}-" in n for n in _temps(tmp_path, "art.tpc")):
                assert time.monotonic() < deadline, "writer never created a temp file"
                time.sleep(0.001)
        else:
            time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()

        temps = _temps(tmp_path, "art.tpc")
        # A writer that got the lock removed its predecessors' leftovers, so they never pile up.
        assert len(temps) <= 1, temps
        stale_seen += bool(temps)
        if path.exists():  # absent only until a first save completes
            seen.add(_check_complete(path))

    assert stale_seen >= 5  # most odd rounds kill mid-write by construction
    assert len(seen) >= 2, seen  # complete new files did replace old ones
    write_artifact(
        path,
        {"writer": -1, "n": 0, "sha256": hashlib.sha256(b"").hexdigest()},
        {"payload": b"", "small": b"0"},
    )
    assert _temps(tmp_path, "art.tpc") == []
    assert _check_complete(path) == (-1, 0)


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    path = tmp_path / "shared.tpc"
    size, count = 1 << 20, 12
    done = threading.Event()

    def reader() -> list[tuple[int, int]]:
        seen = []
        while not done.is_set():
            try:
                seen.append(_check_complete(path))  # raises on a torn or corrupt read
                read_meta(path)
            except FileNotFoundError:
                assert not seen, "the file vanished after it existed"
        return seen

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        readers = [pool.submit(reader) for _ in range(2)]
        try:
            writers = [_spawn_writer(path, w, size, count, start=False) for w in range(4)]
            for proc in writers:  # all four start writing at once
                proc.stdin.write("go\n")
                proc.stdin.flush()
            for proc in writers:
                proc.communicate(timeout=60)
                assert proc.returncode == 0
        finally:
            done.set()
        reads = [r for future in readers for r in future.result()]

    assert reads, "readers never saw a file"
    assert {w for w, _ in reads} <= set(range(4))
    writer, n = _check_complete(path)
    assert writer in range(4) and n == count - 1
    assert _temps(tmp_path, "shared.tpc") == []


# ---------------------------------------------------------------- read only


def test_reading_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "src.tpc"
    write_artifact(source, META, {"a": b"x" * 1000}, sign_key=b"k")
    ro = tmp_path / "ro"
    ro.mkdir()
    path = ro / "a.tpc"
    path.write_bytes(source.read_bytes())  # no lock file beside it
    ro.chmod(
        stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
    )

    opened = []
    real_open = os.open

    def counting_open(file, flags, *args, **kwargs):
        mode = "r" if flags & os.O_ACCMODE == os.O_RDONLY else "w"
        opened.append((os.fspath(file), mode + ("n" if flags & os.O_NONBLOCK else "")))
        return real_open(file, flags, *args, **kwargs)

    try:
        before = sorted(os.listdir(ro))
        mtime = path.stat().st_mtime_ns
        monkeypatch.setattr(os, "open", counting_open)
        read_meta(path)
        read_info(path)
        read_artifact(path)
        read_artifact(path, verify_key=b"k")
        monkeypatch.undo()
        assert sorted(os.listdir(ro)) == before == ["a.tpc"]  # no lock, no temp
        assert path.stat().st_mtime_ns == mtime
        # One open per read, read-only and non-blocking.
        assert opened == [(str(path), "rn")] * 4
    finally:
        ro.chmod(0o755)


# ---------------------------------------------------------------------- system


def test_current_system_shape() -> None:
    import torch

    system = _system.current_system()
    assert system["torch"] == torch.__version__
    assert system["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert system["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(system["platform"], str) and system["os"] == sys.platform
    assert system["cuda"] is None or set(system["cuda"]) == {
        "device_name",
        "capability",
        "cuda_version",
    }
    assert json.loads(json.dumps(system)) == system
    _system.check_compatible(system)
    _system.check_compatible(system, path="model.pt")


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> dict:
    fake = {
        "torch": "2.12.1",
        "python": "3.11.7",
        "platform": "x86_64",
        "os": "linux",
        "cpu_isa": "AVX2",
        "cuda": None,
    }
    monkeypatch.setattr(_system, "current_system", lambda **kwargs: dict(fake))
    monkeypatch.setattr(_system, "_current_cuda", lambda index=None: None)
    return fake


def _incompatible(recorded: dict, device_type: str = "cpu") -> str:
    with pytest.raises(IncompatibleSystemError) as excinfo:
        _system.check_compatible(recorded, device_type, path="model.pt")
    assert isinstance(excinfo.value, PrecompileError)
    message = str(excinfo.value)
    assert "'model.pt'" in message and "\n" not in message
    return message


def test_check_compatible_torch_version(here: dict) -> None:
    message = _incompatible({**here, "torch": "2.13.0"})
    assert "2.13.0" in message and "2.12.1" in message
    assert "torch==2.13.0" in message and "rebuild" in message
    _incompatible({**here, "torch": "2.12.1+cu126"})  # the full string must match


def test_check_compatible_python(here: dict) -> None:
    message = _incompatible({**here, "python": "3.10.14"})
    assert "3.10.14" in message and "3.11.7" in message
    _system.check_compatible({**here, "python": "3.11.2"})  # micro releases differ freely


def test_check_compatible_platform_and_os(here: dict) -> None:
    message = _incompatible({**here, "platform": "aarch64"})
    assert "aarch64" in message and "x86_64" in message
    message = _incompatible({**here, "os": "darwin"})
    assert "darwin" in message and "linux" in message


def test_check_compatible_cpu_isa(here: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    message = _incompatible({**here, "cpu_isa": "AVX512"})
    assert "AVX512" in message and "AVX2" in message
    _system.check_compatible({**here, "cpu_isa": "DEFAULT"})
    _system.check_compatible({**here, "cpu_isa": "AVX2"})
    _incompatible({**here, "cpu_isa": "SVE256"})
    _incompatible({**here, "cpu_isa": "SOMETHING_NEW"})

    here["cpu_isa"] = "AVX512"
    _system.check_compatible({**here, "cpu_isa": "AVX2"})  # lower ISA runs on a higher one
    here["cpu_isa"] = "SVE256"
    _system.check_compatible({**here, "cpu_isa": "SVE256"})
    _incompatible({**here, "cpu_isa": "SVE512"})
    assert _system.cpu_isa_runs_on("DEFAULT", "VSX") and not _system.cpu_isa_runs_on(
        "VSX", "DEFAULT"
    )


def test_check_compatible_reports_every_mismatch_and_skips_missing_keys(
    here: dict,
) -> None:
    message = _incompatible({"torch": "2.13.0", "python": "3.12.1", "cpu_isa": "AVX512"})
    assert "torch 2.13.0" in message and "Python 3.12.1" in message and "AVX512" in message
    _system.check_compatible({"torch": "2.12.1"})  # unrecorded facts are not checked
    _system.check_compatible({})


def test_check_compatible_cuda(here: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    built = {"device_name": "NVIDIA H100", "capability": "9.0", "cuda_version": "12.6"}
    message = _incompatible({**here, "cuda": built}, "cuda")
    assert "9.0" in message and "no CUDA device" in message
    _system.check_compatible({**here, "cuda": built}, "cpu")  # a CPU artifact ignores the GPU

    monkeypatch.setattr(
        _system,
        "_current_cuda",
        lambda index=None: {
            "device_name": "NVIDIA A100",
            "capability": "8.0",
            "cuda_version": "12.6",
        },
    )
    message = _incompatible({**here, "cuda": built}, "cuda:0")
    assert "9.0" in message and "8.0" in message and "A100" in message and "H100" in message
    _system.check_compatible({**here, "cuda": {**built, "capability": "8.0"}}, "cuda")
    _incompatible({**here, "cuda": None}, "cuda")


@pytest.mark.parametrize("start", [b"", b"PT2AOT\x01"])
def test_the_imports_of_torch_compiled_bytes_are_read_past_its_magic(start: bytes) -> None:
    """torch's save_compiled_function writes a pickle up to 2.14 and ``PT2AOT``, a version
    byte and the pickle from 2.15: the modules it imports are read from either (a save on
    2.15 failed reading the magic as a pickle)."""
    import collections
    import pickle

    from torch_precompile.file.layout import torch_compiled_pickle
    from torch_precompile.file.pickle_refs import Ref, pickle_imports

    data = start + pickle.dumps({"state": collections.OrderedDict(a=1)}, protocol=4)
    assert Ref("collections", "OrderedDict") in pickle_imports(torch_compiled_pickle(data))
    if start:
        with pytest.raises(ValueError):
            pickle_imports(data)


# ------------------------------------------------------------------ compressed sections


def test_a_compressed_section_reads_back_whole_and_is_stored_smaller(tmp_path: Path) -> None:
    path = tmp_path / "model.tpc"
    code = b"def step(x):\n    return x * 2 + 1\n" * 4000
    sections = {"lean": code, "weights": random.Random(1).randbytes(1 << 16)}
    write_artifact(path, META, sections, compressed=["lean"])
    entry = read_info(path).sections[0]
    assert entry["encoding"] == "zlib" and entry["size"] == len(code)
    assert entry["length"] < len(code) // 20  # stored compressed
    assert read_artifact(path)[1] == sections
    with open_artifact(path) as reader:  # the load's reader: header only, then the section
        assert reader.read("lean") == code
        assert reader.read("weights") == sections["weights"]


def test_a_flipped_byte_in_a_compressed_section_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "model.tpc"
    write_artifact(path, META, {"lean": b"x = 1\n" * 5000}, compressed=["lean"])
    entry = read_info(path).sections[0]
    data = bytearray(path.read_bytes())
    start = read_info(path).data_start + entry["offset"]
    data[start + entry["length"] // 2] ^= 0x10
    path.write_bytes(data)
    with open_artifact(path) as reader, pytest.raises(ArtifactCorruptedError, match="'lean'"):
        reader.read("lean")


def test_a_section_of_an_unknown_encoding_is_corruption(tmp_path: Path) -> None:
    data = b"abc"
    entry = _entry("lean", 0, data) | {"encoding": "brotli", "size": 3}
    path = tmp_path / "odd.tpc"
    path.write_bytes(_build(_header([entry]), data))
    with open_artifact(path) as reader, pytest.raises(ArtifactCorruptedError, match="brotli"):
        reader.read("lean")


def test_a_version_3_file_is_read_from_its_header_alone(tmp_path: Path, monkeypatch) -> None:
    data = b"weights"
    path = tmp_path / "v3.tpc"
    path.write_bytes(_build(_header([_entry("weights", 0, data)]), data, version=3))
    seen = []
    monkeypatch.setattr(file_read, "_read_open", lambda *a, **k: seen.append(a))
    from torch_precompile.file import reader as file_reader

    monkeypatch.setattr(file_reader, "_read_open", lambda *a, **k: seen.append(a))
    with open_artifact(path) as reader:
        assert reader.info.format_version == 3 and reader.read("weights") == data
    assert seen == []  # not checked whole first: its header's digest vouches for it
