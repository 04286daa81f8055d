"""The saved file end to end: tampering, foreign systems and signing, through Precompile.load.

Byte-level properties of the container (truncation, bit flips, kills,
concurrency) are in test_format.py; this file checks that a real artifact's
payload is never unpickled when the file should not be trusted.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from conftest import run_script

from torch_precompile import (
    ArtifactCorruptedError,
    IncompatibleSystemError,
    Precompile,
    UntrustedArtifactError,
)
from torch_precompile import file as container

KEY = b"build-server-secret"


class _Marker:
    """Unpickling this object creates a file: proof that a payload was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rewrite(src, dst, *, meta_update=None, section_update=None, sign_key=None) -> None:
    meta, sections = container.read_artifact(src)
    meta.update(meta_update or {})
    sections.update(section_update or {})
    container.write_artifact(dst, meta, sections, sign_key=sign_key)


@pytest.fixture(scope="module")
def signed(staged, tmp_path_factory):
    path = tmp_path_factory.mktemp("signed") / "signed.pt"
    Precompile.save(path, staged.artifact, sign_key=KEY)
    return path


def test_signed_file_loads_with_the_right_key(staged, signed) -> None:
    loaded = Precompile.load(signed, verify_key=KEY)
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)


def test_unsigned_or_wrongly_signed_files_are_refused(staged, signed, tmp_path) -> None:
    with pytest.raises(UntrustedArtifactError):
        Precompile.load(staged.path, verify_key=KEY)
    with pytest.raises(UntrustedArtifactError):
        Precompile.load(signed, verify_key=b"another key")


@pytest.mark.parametrize(("key", "error"), [(123, TypeError), (b"", ValueError), ("", ValueError)])
def test_a_bad_verify_key_is_refused_before_the_file_is_opened(
    tmp_path, key: object, error: type[Exception]
) -> None:
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)  # opening it would wait for a writer: the key must be refused first
    with pytest.raises(error, match="verify_key"):
        Precompile.load(fifo, verify_key=key)


def test_tampered_payload_is_never_unpickled(staged, tmp_path) -> None:
    marker = tmp_path / "executed"
    evil = pickle.dumps(_Marker(str(marker)))
    # An attacker without the key re-writes a valid container around a payload.
    forged = tmp_path / "forged.pt"
    _rewrite(staged.path, forged, section_update={"compiled": evil})
    with pytest.raises(UntrustedArtifactError):
        Precompile.load(forged, verify_key=KEY)
    forged_signed = tmp_path / "forged_signed.pt"
    _rewrite(staged.path, forged_signed, section_update={"compiled": evil}, sign_key=b"attacker")
    with pytest.raises(UntrustedArtifactError):
        Precompile.load(forged_signed, verify_key=KEY)
    # Bytes changed after signing: caught by checksum or signature, before unpickling.
    data = bytearray(forged_signed.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(bytes(data))
    with pytest.raises((UntrustedArtifactError, ArtifactCorruptedError)):
        Precompile.load(flipped, verify_key=KEY)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("torch", "2.99.0", "torch"),
        ("python", "3.7.1", "python"),
        ("cpu_isa", "SVE256", "SVE256"),
    ],
)
def test_artifact_from_another_system_is_refused_before_unpickling(
    staged, tmp_path, field, value, needle
) -> None:
    marker = tmp_path / "executed"
    meta, _ = container.read_artifact(staged.path)
    system = dict(meta["system"], **{field: value})
    path = tmp_path / f"foreign_{field}.pt"
    _rewrite(
        staged.path,
        path,
        meta_update={"system": system},
        section_update={"compiled": pickle.dumps(_Marker(str(marker)))},
    )
    with pytest.raises(IncompatibleSystemError) as info:
        Precompile.load(path)
    message = str(info.value)
    assert needle in message and str(staged.artifact.system[field]) in message
    assert not marker.exists()


def test_loading_writes_nothing_beside_the_artifact(staged, tmp_path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "model.pt"
    path.write_bytes(staged.path.read_bytes())
    os.chmod(directory, 0o555)
    try:
        before = sorted(os.listdir(directory))
        run_script(
            """
            import sys, torch
            from torch_precompile import Precompile
            art = Precompile.load(sys.argv[1])
            with torch.no_grad():
                out = art(torch.zeros(2, 32, dtype=torch.long))
            assert out.shape == (2, 32, 1000)
            """,
            str(path),
        )
        assert sorted(os.listdir(directory)) == before
    finally:
        os.chmod(directory, 0o755)
