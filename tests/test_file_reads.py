"""One pass over the file: what a load reads and checksums, counted by the reader's trace.

The session's transformer artifact (``staged`` in conftest, a lean one) is
loaded in fresh processes inside ``torch_precompile.file.trace.recording()``: each
section is read and hashed at most once, ``compiled`` never (it is read only to
save the artifact again), and a kernel already in the kernel directory is not
read at all. ``inspect`` reads the header only unless ``--verify``. A flipped
byte in a section the load uses is the typed error; a flipped byte elsewhere
never changes an answer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import script_json

from torch_precompile import ArtifactCorruptedError, Precompile
from torch_precompile import file as container
from torch_precompile.cli.main import main as cli_main
from torch_precompile.file.trace import recording

LOAD = """
    import json, os, sys, torch
    from torch_precompile import Precompile
    from torch_precompile.file.trace import recording
    path, io_path, resave = sys.argv[1], sys.argv[2], sys.argv[3]
    io = torch.load(io_path)
    with recording() as trace:
        art = Precompile.load(path)
    with torch.no_grad():
        diff = float((art(io["ids"]) - io["expected"]).abs().max())
    counts = {
        name: [trace.count("read", name), trace.count("hash", name)]
        for name in trace.names("read") | trace.names("hash")
    }
    out = {"counts": counts, "diff": diff, "dynamo": "torch._dynamo" in sys.modules}
    if resave != "-":
        os.remove(path)  # the bytes loaded stay readable: the file is held open
        with recording() as again:
            Precompile.save(resave, art)
        out["resave"] = {n: again.count("hash", n) for n in again.names("hash")}
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def io_file(staged: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reads") / "io.pt"
    torch.save({"ids": staged.example, "expected": staged.expected}, path)
    return path


def _sections(path: Path) -> dict[str, dict[str, Any]]:
    with container.open_artifact(path) as reader:
        return {
            s["name"]: dict(s, start=reader.info.data_start + s["offset"])
            for s in reader.info.sections
        }


def _flipped(src: Path, dst: Path, section: str) -> Path:
    """A copy of ``src`` with one byte in the middle of ``section`` flipped."""
    entry = _sections(src)[section]
    data = bytearray(src.read_bytes())
    data[entry["start"] + entry["length"] // 2] ^= 0x40
    dst.write_bytes(bytes(data))
    return dst


def test_lean_load_reads_and_hashes_each_section_once_and_never_compiled(
    staged: Any, io_file: Path, tmp_path: Path
) -> None:
    sections = _sections(staged.path)
    kernels = {n for n in sections if n.startswith("kernel/")}
    assert kernels and "lean" in sections and "compiled" in sections
    env = {"TORCH_PRECOMPILE_KERNEL_DIR": str(tmp_path / "kernels")}
    resaved, removed = tmp_path / "resaved.pt", tmp_path / "removed.pt"
    shutil.copyfile(staged.path, removed)  # removed after the load, before the re-save
    cold = script_json(LOAD, removed, io_file, resaved, **env)
    assert cold["diff"] < 1e-4 and not cold["dynamo"]
    counts = cold["counts"]
    assert all(reads <= 1 and hashes <= 1 for reads, hashes in counts.values()), counts
    assert "compiled" not in counts, "the lean load touched the compiled section"
    assert set(counts) == {"lean", "skeleton", "weights"} | kernels
    assert "<whole file>" not in counts  # the header pins each section's checksum
    # Saving it again reads compiled then, and the kernels again (from the file the load
    # opened, removed since, checked against its header), once each; the copy holds the
    # same bytes.
    assert cold["resave"] == dict.fromkeys({"compiled"} | kernels, 1)
    _, original = container.read_artifact(staged.path)
    _, copy = container.read_artifact(resaved)
    assert copy.keys() == original.keys()
    assert all(copy[n] == original[n] for n in original)
    # Kernels already in the kernel directory are not read at all.
    warm = script_json(LOAD, staged.path, io_file, "-", **env)
    assert warm["diff"] < 1e-4
    assert set(warm["counts"]) == {"lean", "skeleton", "weights"}


def test_inspect_reads_the_header_only_unless_asked_to_verify(
    staged: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with recording() as trace:
        assert cli_main(["inspect", str(staged.path)]) == 0
    assert trace.of("hash") == [] and trace.of("read") == []
    assert [e.name for e in trace.of("header")] == ["header"]
    with recording() as trace:
        assert cli_main(["inspect", "--verify", str(staged.path)]) == 0
    assert [e.name for e in trace.of("hash")] == ["<whole file>"]
    capsys.readouterr()
    # A flipped weight: the header is intact, so inspect shows it; --verify refuses it.
    bad = _flipped(staged.path, tmp_path / "bad.pt", "weights")
    assert cli_main(["inspect", str(bad)]) == 0
    assert cli_main(["inspect", "--verify", str(bad)]) == 1
    assert "SHA-256 checksum does not match" in capsys.readouterr().err


@pytest.mark.parametrize("section", ["weights", "lean", "skeleton", "kernel"])
def test_a_flipped_byte_in_a_used_section_is_the_typed_error(
    staged: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str
) -> None:
    if section == "kernel":
        section = min(n for n in _sections(staged.path) if n.startswith("kernel/"))
        monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(tmp_path / "empty"))
    bad = _flipped(staged.path, tmp_path / "bad.pt", section)
    with pytest.raises(ArtifactCorruptedError, match=f"section '{section}' fails its SHA-256"):
        Precompile.load(bad)


def test_a_flipped_byte_the_load_does_not_use_never_changes_an_answer(
    staged: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compiled`` flipped: the lean load answers as eager does; saving it again, or
    loading through PyTorch's full path, is the typed error. A kernel flipped while
    the kernel directory holds it: the directory's copy, named by the header's
    checksums, runs."""
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(tmp_path / "kernels"))
    Precompile.load(staged.path)  # fills the kernel directory
    bad = _flipped(staged.path, tmp_path / "compiled.pt", "compiled")
    loaded = Precompile.load(bad)
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)
    with pytest.raises(ArtifactCorruptedError, match="section 'compiled' fails its SHA-256"):
        Precompile.save(tmp_path / "again.pt", loaded)
    assert not os.path.exists(tmp_path / "again.pt")
    for name in ("TORCH_PRECOMPILE_LEAN", "TORCH_PRECOMPILE_FAST_LOAD"):  # and its old name
        monkeypatch.setenv(name, "0")  # the full path, which reads the corrupt section
        with pytest.raises(ArtifactCorruptedError, match="section 'compiled' fails its SHA-256"):
            Precompile.load(bad)
        monkeypatch.delenv(name)
    kernel = min(n for n in _sections(staged.path) if n.startswith("kernel/"))
    flipped_kernel = Precompile.load(_flipped(staged.path, tmp_path / "kernel.pt", kernel))
    with torch.no_grad():
        torch.testing.assert_close(flipped_kernel(staged.example), staged.expected)
