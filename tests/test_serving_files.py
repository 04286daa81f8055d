"""Reading artifact files as a server must: no hang, refusals in O(header), a safe inspect.

Only regular files are opened (a named pipe or a device is refused before it
can block or stream forever); with a ``verify_key`` an unsigned file is refused
from its fixed header, before the payload is read; the checksum is streamed, so
reading the header of a large file costs O(header) memory; ``inspect`` turns any
header content into its view or a one-line error, and never writes a control
character to the terminal. No compilation happens here: the files are made with
``container.write_artifact`` (the loader's reading is the same code), except the
one ``Precompile.load`` of a pipe.
"""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from torch_precompile import (
    ArtifactCorruptedError,
    Precompile,
    UntrustedArtifactError,
)
from torch_precompile import file as container
from torch_precompile.cli.main import main as cli_main
from torch_precompile.cli.text import printable
from torch_precompile.file import read_whole as file_read
from torch_precompile.file.header import Header, VariantRecord

REPO = Path(__file__).resolve().parents[1]
META = Header(
    producer="test",
    created="2026-11-23T00:00:00+00:00",
    kind="function",
    device_type="cpu",
    system={},
    cudagraphs=False,
    bundle=False,
    variants=(VariantRecord(False, False, {}, (), {}, {}),),
    sizes={},
    guards_text="",
).to_json()


def _meta(variant: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """META with top-level fields and fields of its variant replaced."""
    return {**META, **top, "variants": [{**META["variants"][0], **(variant or {})}]}


SECTIONS = {"compiled": b"c" * 5000, "weights": bytes(range(256)) * 40}


def _finishes(fn: Callable[[], Any], release: Callable[[], None], timeout: float = 20) -> Any:
    """Run ``fn`` in a thread; fail (after unblocking it with ``release``) if it hangs."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        release()
        t.join(10)
        pytest.fail(f"{fn} blocked for more than {timeout} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A named pipe no one writes to; opening it for reading without O_NONBLOCK blocks."""
    path = tmp_path / "model.pt"
    os.mkfifo(path)
    yield path


def _release(path: Path) -> Callable[[], None]:
    def release() -> None:  # a writer unblocks a reader stuck in open()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    return release


@pytest.mark.parametrize(
    "read",
    [
        lambda p: container.read_info(p),
        lambda p: container.read_artifact(p),
        lambda p: container.read_artifact(p, verify_key=b"k"),
        lambda p: Precompile.load(p),
        lambda p: Precompile.load(p, verify_key=b"k"),
    ],
    ids=["read_info", "read_artifact", "read_artifact_verify", "load", "load_verify"],
)
def test_named_pipe_is_refused_without_blocking(fifo: Path, read: Callable[[Path], Any]) -> None:
    with pytest.raises(ArtifactCorruptedError, match="is a named pipe, not a torch_precompile"):
        _finishes(lambda: read(fifo), _release(fifo))


def test_pipe_swapped_in_after_the_stat_is_caught_on_the_descriptor(
    fifo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the path becomes a pipe between the check and the open, the non-blocking open
    returns at once and the check on the descriptor refuses it."""
    real_stat = os.stat

    def regular_stat(path: Any, *a: Any, **k: Any) -> Any:
        st = real_stat(path, *a, **k)
        if os.fspath(path) == str(fifo):
            fields = list(st)
            fields[stat.ST_MODE] = stat.S_IFREG | 0o644
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "stat", regular_stat)
    with pytest.raises(ArtifactCorruptedError, match="named pipe"):
        _finishes(lambda: container.read_info(fifo), _release(fifo))


def test_character_device_is_refused_not_streamed() -> None:
    """``/dev/zero`` never ends: it is refused from its type."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    with pytest.raises(ArtifactCorruptedError, match="character device"):
        _finishes(lambda: Precompile.load("/dev/zero"), lambda: None)


def test_inspect_on_a_named_pipe_exits_with_one_line(fifo: Path) -> None:
    """The command line on a pipe: exit status 1 and one line, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", str(fifo)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "named pipe" in lines[0], proc.stderr


# ------------------------------------------------- refusing from the header


def _big_unsigned(tmp_path: Path, size: int) -> Path:
    """An unsigned artifact's fixed header in a sparse file of ``size`` bytes."""
    small = tmp_path / "small.pt"
    container.write_artifact(small, META, SECTIONS)
    data = bytearray(small.read_bytes())
    struct.pack_into("<Q", data, 24, size)  # the recorded total length
    big = tmp_path / "big.pt"
    with open(big, "wb") as f:
        f.write(data)
        f.truncate(size)
    return big


def test_verify_key_refuses_a_1_gib_unsigned_file_from_its_header(tmp_path: Path) -> None:
    """``load(verify_key=)`` on a 1 GiB unsigned file: refused after the fixed header, in
    a few milliseconds and without reading the payload into memory."""
    big = _big_unsigned(tmp_path, 1 << 30)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(UntrustedArtifactError, match="is not signed"):
            container.read_artifact(big, verify_key=b"k")
        with pytest.raises(UntrustedArtifactError, match="is not signed"):
            Precompile.load(big, verify_key=b"k")
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5, elapsed
    assert peak < 1 << 20, peak


def test_reading_the_header_of_a_large_file_streams_the_checksum(tmp_path: Path) -> None:
    """``read_info`` (what inspect uses) checks the whole-file SHA-256 in chunks: a 256 MiB
    file costs a few MiB of memory (here the checksum fails: the file is a sparse fake)."""
    big = _big_unsigned(tmp_path, 256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactCorruptedError, match="SHA-256 checksum does not match"):
            container.read_info(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_unsigned_decision_comes_before_the_checksum(tmp_path: Path) -> None:
    """With a verify_key, an unsigned file is untrusted whatever its payload holds (its
    checksum is not even computed); without one, the same file reads as corrupted."""
    path = tmp_path / "a.pt"
    container.write_artifact(path, META, SECTIONS)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(data)
    with pytest.raises(UntrustedArtifactError, match="not signed"):
        container.read_artifact(path, verify_key=b"k")
    with pytest.raises(ArtifactCorruptedError, match="SHA-256"):
        container.read_artifact(path)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_streamed_checks_across_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Checksum and HMAC computed chunk by chunk (tiny chunks put every boundary inside a
    field) accept a good file, and catch a flipped byte and a wrong key."""
    monkeypatch.setattr(file_read, "_CHUNK", chunk)
    path = tmp_path / "a.pt"
    container.write_artifact(path, META, SECTIONS, sign_key=b"key")
    meta, sections = container.read_artifact(path, verify_key=b"key")
    assert meta == META and sections == SECTIONS
    assert container.read_info(path).signed
    with pytest.raises(UntrustedArtifactError, match="does not match verify_key"):
        container.read_artifact(path, verify_key=b"other")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    with pytest.raises(ArtifactCorruptedError, match="SHA-256"):
        container.read_artifact(path, verify_key=b"key")


@pytest.mark.parametrize(
    ("read", "at_call"),
    [(container.read_info, 3), (container.read_artifact, 1)],
    ids=["info", "all"],
)
def test_file_shrinking_while_read_is_corrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: Callable[[Path], Any], at_call: int
) -> None:
    """A file truncated in place while it is read (chunk by chunk for the header, at
    once for the whole file): a clean corrupted error, no hang."""
    monkeypatch.setattr(file_read, "_CHUNK", 1000)
    path = tmp_path / "a.pt"
    container.write_artifact(path, META, SECTIONS)
    real = file_read._read_exactly
    calls = []

    def shrink_then_read(f: Any, p: str, offset: int, into: memoryview) -> None:
        calls.append(offset)
        real(f, p, offset, into)
        if len(calls) == at_call:
            os.truncate(path, 2000)

    monkeypatch.setattr(file_read, "_read_exactly", shrink_then_read)
    with pytest.raises(ArtifactCorruptedError, match="became shorter"):
        read(path)


# ------------------------------------------------------------------- inspect


def _inspect(path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    rc = cli_main(["inspect", *flags, str(path)])
    out, err = capsys.readouterr()
    return rc, out, err


MALFORMED = {
    "system_is_a_list": _meta(system=["torch", 1]),
    "sizes_are_strings": _meta(sizes={"weights": "big"}),
    "size_is_huge": _meta(sizes={"weights": 10**30}),
    "kind_is_unknown": _meta(kind="lambda"),
    "no_variants": {**META, "variants": []},
    "timing_is_a_dict": _meta({"timings": {"inductor": {"s": 1}}}),
    "timing_is_huge": _meta({"timings": {"inductor": 1e300}}),
    "signature_is_a_number": _meta({"signature": 7}),
    "guards_is_a_string": _meta({"guards": "all of them"}),
    "guard_entry_is_wrong": _meta({"guards": [{"phase": 3, "kind": [], "expr": None}]}),
    "training_is_missing": {
        **META,
        "variants": [{k: v for k, v in META["variants"][0].items() if k != "training"}],
    },
}


@pytest.mark.parametrize("field", sorted(MALFORMED))
def test_inspect_malformed_header_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """A header with fields of the wrong type or absurd values (checksum valid): exit 1,
    one line naming the field, no traceback; ``--json`` still prints it."""
    path = tmp_path / "odd.pt"
    container.write_artifact(path, MALFORMED[field], SECTIONS)
    rc, out, err = _inspect(path, capsys)
    assert rc == 1 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("torch-precompile: error: ") and "header field 'meta." in err, err
    assert "Traceback" not in err
    rc, out, err = _inspect(path, capsys, "--json")
    assert rc == 0 and '"meta"' in out


def test_inspect_escapes_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ANSI escapes, a carriage return, a fake extra line and a bidi override in header
    strings, section names and the file name reach the terminal escaped, never raw."""
    evil = "\x1b[31mred\x1b[0m\r\nFAKE LINE\u202egnp.\x07"
    meta = _meta({"signature": {"signature": evil}}, producer=evil, sizes={evil: 1})
    meta["system"] = {"torch": evil, "cpu_isa": evil}
    path = tmp_path / "name\x1b]0;title\x07.pt"
    container.write_artifact(path, meta, {evil: b"x"})
    for flags in ((), ("--json",)):
        rc, out, err = _inspect(path, capsys, *flags)
        assert rc == 0, err
        for bad in ("\x1b", "\r", "\x07", "\u202e"):
            assert bad not in out + err, (flags, repr(bad))
    rc, out, _ = _inspect(path, capsys)
    assert "\\x1b[31mred" in out and "\\u202e" in out
    assert not any(line.startswith("FAKE LINE") for line in out.splitlines())


def test_inspect_error_lines_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error naming a file whose name holds escape codes prints them escaped."""
    path = tmp_path / "\x1b[2Jgone.pt"
    path.write_bytes(b"not an artifact at all")
    rc, _out, err = _inspect(path, capsys)
    assert rc == 1 and "\x1b" not in err and "\\x1b[2J" in err, err
    assert len(err.strip().splitlines()) == 1


def test_printable_keeps_plain_text() -> None:
    text = "torch 2.13.0+cpu, Python 3.11 — héllo, 日本"
    assert printable(text) == text
    assert printable("a\tb\x1bc\u2028d") == "a\\tb\\x1bc\\u2028d"
    assert printable("x" * 50, limit=10) == "x" * 10 + "... (40 more characters)"
