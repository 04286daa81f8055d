"""Precompile.save: one self-contained file, checked inputs, nothing lost."""

from __future__ import annotations

import os

import pytest
import torch

from torch_precompile import Precompile
from torch_precompile import file as container


def test_save_writes_one_file_with_a_readable_header(staged) -> None:
    assert staged.path.exists() and staged.path.stat().st_size > 1_000_000
    # One artifact (plus the writers' lock file, which must outlive the save).
    assert set(os.listdir(staged.path.parent)) <= {"transformer.pt", "transformer.pt.lock"}
    meta = container.read_meta(staged.path)
    assert meta["kind"] == "module"
    assert meta["variants"][0]["training"] is False and meta["bundle"] is False
    assert meta["system"]["torch"] == torch.__version__
    assert "input 'ids': int64 (2, 32) on cpu" in meta["guards_text"]
    assert meta["sizes"]["weights"] >= sum(p.numel() * 4 for p in staged.model.parameters())
    assert meta["sizes"]["compiled"] > 0


def test_weights_travel_in_the_file(staged) -> None:
    _, sections = container.read_artifact(staged.path)
    assert {"compiled", "weights", "skeleton"} <= set(sections)


def test_bytecode_from_another_capture_is_rejected(staged, tmp_path) -> None:
    other = Precompile.dynamo(lambda x: x.cos(), torch.randn(2)).bytecode
    with pytest.raises(ValueError, match="bytecode given to save\\(\\) does not belong"):
        Precompile.save(tmp_path / "x.pt", staged.artifact, other, staged.inductor.guards)
    assert not (tmp_path / "x.pt").exists()


def test_guards_from_another_capture_are_rejected(staged, tmp_path) -> None:
    other = Precompile.dynamo(lambda x: x.cos(), torch.randn(2)).guards
    with pytest.raises(
        ValueError, match=r"guards given to save\(\) do not belong.*another capture"
    ):
        Precompile.save(tmp_path / "x.pt", staged.artifact, staged.dynamo.bytecode, other)


def test_earlier_stage_guards_are_accepted(staged, tmp_path) -> None:
    # Guards of an earlier stage are a prefix of the artifact's: they belong to it.
    Precompile.save(
        tmp_path / "ok.pt", staged.artifact, staged.dynamo.bytecode, staged.dynamo.guards
    )
    assert (tmp_path / "ok.pt").exists()


def test_a_failed_save_keeps_the_previous_file(staged, tmp_path, monkeypatch) -> None:
    path = tmp_path / "model.pt"
    Precompile.save(path, staged.artifact)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        Precompile.save(path, staged.artifact)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert set(os.listdir(tmp_path)) == {"model.pt", "model.pt.lock"}  # no temp file left


def test_save_rejects_a_non_artifact(tmp_path) -> None:
    with pytest.raises(TypeError, match="save\\(\\) takes a PrecompiledArtifact"):
        Precompile.save(tmp_path / "x.pt", object())


def test_save_and_load_need_no_numpy(staged, tmp_path) -> None:
    """numpy is not a dependency: a process where it cannot be imported loads,
    saves again (the weights' bytes included) and loads that copy, equal to eager."""
    from conftest import run_script

    torch.save((staged.example, staged.expected), tmp_path / "ref.pt")
    proc = run_script(
        """
        import sys
        sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
        import torch
        from torch_precompile import Precompile
        src, dst, ref = sys.argv[1:]
        ids, want = torch.load(ref)
        Precompile.save(dst, Precompile.load(src))
        with torch.no_grad():
            got = Precompile.load(dst)(ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        print("numpy" in sys.modules and sys.modules["numpy"] is None)
        """,
        str(staged.path),
        str(tmp_path / "again.pt"),
        str(tmp_path / "ref.pt"),
    )
    assert proc.stdout.strip().endswith("True")
