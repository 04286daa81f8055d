"""The weights' digest hashed on every core (``sha256_tree``): every byte still checked.

A section of ``MIN_TREE`` bytes or more is recorded with a SHA-256 tree over
``CHUNK``-byte leaves (docs/FORMAT.md); here both are made small so the
session's transformer (``staged`` in conftest) has many chunks. A flipped byte
in the first, a middle or the last chunk is ``ArtifactCorruptedError`` from
``Precompile.load``; a signed file whose weights and tree digest were both
rewritten is refused by its HMAC; a file with the plain SHA-256 (every file
written before the tree) loads and is checked as before.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_precompile import ArtifactCorruptedError, Precompile, UntrustedArtifactError
from torch_precompile import file as container
from torch_precompile.file import treehash
from torch_precompile.file.layout import FIXED

CHUNK = 1 << 16
MIN_TREE = 1 << 20  # the weights (8.5 MB) get a tree of 130 chunks; the rest plain
KEY = b"tree-digest-test-key"


@pytest.fixture(autouse=True)
def small_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(treehash, "CHUNK", CHUNK)
    monkeypatch.setattr(treehash, "MIN_TREE", MIN_TREE)


@pytest.fixture(scope="module")
def saved(staged: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tree")
    paths = {"plain": out / "plain.pt", "signed": out / "signed.pt"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(treehash, "CHUNK", CHUNK)
        mp.setattr(treehash, "MIN_TREE", MIN_TREE)
        Precompile.save(
            paths["plain"], staged.artifact, staged.dynamo.bytecode, staged.inductor.guards
        )
        Precompile.save(
            paths["signed"],
            staged.artifact,
            staged.dynamo.bytecode,
            staged.inductor.guards,
            sign_key=KEY,
        )
    return paths


def _weights(path: Path) -> dict[str, Any]:
    with container.open_artifact(path) as reader:
        entry = reader.info.section("weights")
        assert entry is not None
        return dict(entry, start=reader.info.data_start + entry["offset"])


def _flip(src: Path, dst: Path, at: int) -> Path:
    data = bytearray(src.read_bytes())
    data[at] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst


def test_tree_digest_is_the_documented_formula() -> None:
    data = bytes(range(256)) * 1000  # 256000 bytes: 3 full chunks and a short one
    leaves = b"".join(
        hashlib.sha256(data[i : i + CHUNK]).digest() for i in range(0, len(data), CHUNK)
    )
    head = b"torch_precompile sha256-tree" + struct.pack("<QQ", CHUNK, len(data))
    assert treehash.tree_sha256(data, CHUNK) == hashlib.sha256(head + leaves).hexdigest()
    # The layout is hashed in: another chunk size, or the plain digest, differs.
    assert treehash.tree_sha256(data, 2 * CHUNK) != treehash.tree_sha256(data, CHUNK)
    assert treehash.tree_sha256(data, CHUNK) != hashlib.sha256(data).hexdigest()
    empty = b"torch_precompile sha256-tree" + struct.pack("<QQ", CHUNK, 0)
    assert (
        treehash.tree_sha256(b"", CHUNK)
        == hashlib.sha256(empty + hashlib.sha256(b"").digest()).hexdigest()
    )


def test_large_sections_carry_a_tree_digest_and_load(staged: Any, saved: dict[str, Path]) -> None:
    entry = _weights(saved["plain"])
    assert entry["length"] > 4 * CHUNK  # several chunks: first, middle and last differ
    assert entry["tree_chunk"] == CHUNK and "sha256" not in entry
    with container.open_artifact(saved["plain"]) as reader:
        table = reader.info.sections
    # From MIN_TREE bytes up a tree, under it the plain SHA-256 (kernels, the skeleton).
    assert any("sha256" in s for s in table)
    assert all(("sha256_tree" in s) == (s["length"] >= MIN_TREE) for s in table)
    assert all(("sha256" in s) != ("sha256_tree" in s) for s in table)
    loaded = Precompile.load(saved["plain"])
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_chunk_is_the_typed_error(
    saved: dict[str, Path], tmp_path: Path, where: str
) -> None:
    entry = _weights(saved["plain"])
    chunks = -(-entry["length"] // CHUNK)
    index = {"first": 0, "middle": chunks // 2, "last": chunks - 1}[where]
    at = entry["start"] + min(index * CHUNK + 7, entry["length"] - 1)
    bad = _flip(saved["plain"], tmp_path / "bad.pt", at)
    with pytest.raises(ArtifactCorruptedError, match="section 'weights' fails its SHA-256"):
        Precompile.load(bad)
    with pytest.raises(ArtifactCorruptedError, match="SHA-256 checksum does not match"):
        container.read_artifact(bad)  # the whole file's digest, checked first there


def _forge(src: Path, dst: Path, at: int) -> Path:
    """``src`` with a weight byte flipped and every digest recomputed to match: the
    tree digest in the header, the header's SHA-256, the file's SHA-256; not the HMAC."""
    data = bytearray(src.read_bytes())
    data[at] ^= 0x01
    _, _, _, header_len, _ = FIXED.unpack_from(data)
    start = FIXED.size + 32
    header = json.loads(bytes(data[start : start + header_len]))
    data_start = start + header_len
    for s in header["sections"]:
        if s["name"] == "weights":
            body = data[data_start + s["offset"] : data_start + s["offset"] + s["length"]]
            s["sha256_tree"] = treehash.tree_sha256(bytes(body), s["tree_chunk"])
    raw = json.dumps(header, ensure_ascii=False, allow_nan=False).encode()
    assert len(raw) == header_len  # the same digits' length: the offsets stay
    data[start : start + header_len] = raw
    data[FIXED.size : start] = hashlib.sha256(raw).digest()
    data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    dst.write_bytes(bytes(data))
    return dst


def test_a_signed_file_with_rewritten_weights_and_digests_is_refused(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    entry = _weights(saved["signed"])
    forged = _forge(saved["signed"], tmp_path / "forged.pt", entry["start"] + entry["length"] // 2)
    Precompile.load(saved["signed"], verify_key=KEY)  # the original passes
    with pytest.raises(UntrustedArtifactError, match="does not match verify_key"):
        Precompile.load(forged, verify_key=KEY)


def test_a_file_with_the_plain_sha256_still_loads_and_is_checked(
    staged: Any, tmp_path: Path
) -> None:
    """``staged`` was saved with the plain SHA-256 for every section (its weights are
    under the default 64 MiB), as every file written before the tree digest."""
    entry = _weights(staged.path)
    assert "sha256" in entry and "sha256_tree" not in entry
    loaded = Precompile.load(staged.path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)
    bad = _flip(staged.path, tmp_path / "bad.pt", entry["start"] + entry["length"] - 1)
    with pytest.raises(ArtifactCorruptedError, match="section 'weights' fails its SHA-256"):
        Precompile.load(bad)


@pytest.mark.parametrize(
    "fields",
    [{"sha256_tree": "0" * 64}, {"sha256_tree": "0" * 64, "tree_chunk": 16, "x": 1}],
)
def test_a_table_entry_with_a_bad_tree_is_refused_from_the_header(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    """No chunk size, or one under 4096: refused before any section is read."""
    path = tmp_path / "t.pt"
    container.write_artifact(path, {}, {"s": b"x" * 100})
    data = bytearray(path.read_bytes())
    _, _, _, header_len, _ = FIXED.unpack_from(data)
    start = FIXED.size + 32
    header = json.loads(bytes(data[start : start + header_len]))
    entry = header["sections"][0]
    del entry["sha256"]
    entry.update(fields)
    raw = json.dumps(header).encode()
    fixed = FIXED.pack(*FIXED.unpack_from(data)[:3], len(raw), len(data) - header_len + len(raw))
    body = fixed + hashlib.sha256(raw).digest() + raw + bytes(data[start + header_len : -32])
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(ArtifactCorruptedError, match=r"invalid (sha256|tree_chunk)"):
        container.open_artifact(path)


@pytest.mark.parametrize("rows", [512, 8])  # 2 MiB of weights (a tree), 32 KiB (plain)
def test_a_tp_shard_is_checked_as_it_is_read(tmp_path: Path, rows: int) -> None:
    """A rank's shard file (``PATH.rank<r>-of-<n>``) is read as a load reads its weights:
    copied out and checked at once; a flipped weight byte is ``ArtifactCorruptedError``."""
    from types import SimpleNamespace

    from torch_precompile.distributed.shards import read_shard, shard_path
    from torch_precompile.lean.standin.module import pack_tensors

    torch.manual_seed(0)
    tensors = {"w": torch.randn(rows, 1024), "b": torch.randn(1024)}
    layout = SimpleNamespace(world_size=2, layout_id="L1", tensors=dict.fromkeys(tensors))
    code = tmp_path / "m.pt"
    spath = shard_path(code, 1, 2)
    meta = {"distributed_shard": {"rank": 1, "world_size": 2, "layout_id": "L1"}}
    container.write_artifact(spath, meta, {"weights": pack_tensors(tensors)})
    got = read_shard(str(code), layout, 1)  # type: ignore[arg-type]
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
    entry = _weights(Path(spath))
    assert ("sha256_tree" in entry) == (rows == 512)
    _flip(Path(spath), Path(spath), entry["start"] + entry["length"] // 2)
    with pytest.raises(ArtifactCorruptedError, match="section 'weights' fails its SHA-256"):
        read_shard(str(code), layout, 1)  # type: ignore[arg-type]


def test_copy_checked_keeps_its_source_alive_while_it_copies() -> None:
    """``copy_checked`` returns before its copies end: a source the caller drops at once
    (here a temporary buffer, collected) is still read whole, and its digest is the
    tree's. Before, the threads held its address only, and read freed memory."""
    import gc
    import os

    from torch_precompile.lean.standin.h2d import copy_checked

    data = os.urandom((24 << 20) + 4321)
    good = treehash.tree_sha256(data, CHUNK)
    for lo, hi in [(0, len(data)), (999, len(data) - 5)]:
        check = treehash.TreeCheck(memoryview(data), CHUNK, good)
        out = copy_checked(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), (lo, hi), "cpu", check
        )
        gc.collect()
        assert check.matches()
        assert bytes(out.numpy()) == data[lo:hi]


def test_the_copying_threads_leave_two_cores_to_a_gpu_load_and_take_every_core_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weights' copying and hashing threads: on the CPU one per core (at most 16);
    for a GPU two cores fewer on a host of more than four (the load's own thread and the
    warm-up run beside them), never fewer than one, never more than the leaves."""
    from torch_precompile.lean.standin import h2d

    rows = [(1, 1, 1), (2, 2, 2), (4, 4, 4), (5, 5, 3), (16, 16, 14), (32, 16, 16)]
    for n, on_cpu, on_gpu in rows:
        monkeypatch.setattr(h2d, "cores", lambda n=n: n)
        assert (h2d._workers(False, 1000), h2d._workers(True, 1000)) == (on_cpu, on_gpu), n
        assert h2d._workers(True, 3) == min(3, on_gpu)
