"""A file names the package's code by stable name (``torch_precompile._stable``), so
moving a module never breaks a file; module paths that files already hold (older
files, PyTorch's record of traced code) are read through the one table of moves."""

from __future__ import annotations

import importlib
import pickle
import re
import sys
import types

import pytest
import torch
from conftest import script_json

from torch_precompile import _stable
from torch_precompile.lean import pickling


def _package_paths(data: bytes) -> set[str]:
    """The package's module paths a pickle refers to (protocol 4 writes each as a string)."""
    return {m.decode() for m in re.findall(rb"torch_precompile(?:\.[A-Za-z_][A-Za-z0-9_]*)+", data)}


def test_a_saved_file_pickles_the_package_only_by_stable_name(staged) -> None:
    data = staged.path.read_bytes()
    # The lean section's code objects and the guard state go by stable name ...
    assert "torch_precompile._stable" in _package_paths(data)
    # ... and no pickle in the file names a module of the package (the functions
    # that rebuild code objects and closures were named by module path before).
    assert _package_paths(data) == {"torch_precompile._stable"}
    out = script_json(
        """
        import json, sys, torch
        from torch_precompile import Precompile
        loaded = Precompile.load(sys.argv[1])
        ids = torch.load(sys.argv[2])
        with torch.no_grad():
            print(json.dumps(loaded(ids).tolist()))
        """,
        staged.path,
        _saved(staged),
    )
    torch.testing.assert_close(torch.tensor(out), staged.expected)


def _saved(staged) -> str:
    path = staged.path.with_suffix(".ids")
    torch.save(staged.example, path)
    return str(path)


def _closure_function() -> types.FunctionType:
    scale = 3

    def inner(x: int) -> int:
        return x * scale

    return inner  # type: ignore[return-value]


def test_the_lean_pickler_names_its_helpers_by_stable_name() -> None:
    fn = _closure_function()
    data = pickling.dumps_lean(fn)
    assert _package_paths(data) == {"torch_precompile._stable"}
    rebuilt = pickle.loads(data)
    assert rebuilt(5) == 15 and rebuilt.__qualname__ == fn.__qualname__


def _with_module_path(data: bytes, new: str, old: str) -> bytes:
    """``data`` (protocol 4, short strings) with one module path string replaced."""
    a, b = new.encode(), old.encode()
    assert len(a) < 256 and len(b) < 256
    return data.replace(bytes([0x8C, len(a)]) + a, bytes([0x8C, len(b)]) + b)


def test_module_paths_of_older_files_read_through_the_table_only_while_loading() -> None:
    # A code object as files written before stable names pickled it: by the helper's
    # module path, here the one it had before the subpackage layout.
    code = _closure_function().__code__
    stripped = code.replace(co_consts=(None,) * len(code.co_consts))
    old = pickle.dumps((pickling._code, (b"", ())), protocol=4)
    old = _with_module_path(
        old, "torch_precompile.lean.pickling", "torch_precompile._compat.pickling"
    )
    assert b"torch_precompile._compat.pickling" in old
    with pytest.raises(ModuleNotFoundError, match=r"_compat\.pickling"):
        pickle.loads(old)  # outside a load, the old path is not importable
    with _stable.moved_modules_answered():
        helper, _ = pickle.loads(old)
        assert helper is pickling._code
        assert helper(__import__("marshal").dumps(stripped), code.co_consts) == code
    assert not any(isinstance(f, type(_stable._FINDER)) for f in sys.meta_path)
    assert "torch_precompile._compat.pickling" in sys.modules  # the alias read stays
    assert _stable.today("torch_precompile.file.load") == "torch_precompile.serialization.load"
    assert _stable.today("torch_precompile.generation.generator") == (
        "torch_precompile.generation.compile"
    )
    assert _stable.today("torch_precompile.generation.slots") == "torch_precompile.generation.slots"
    assert _stable.today("transformers.generation") == "transformers.generation"


def test_every_stable_name_resolves_and_every_move_lands_on_a_module() -> None:
    for name, path in _stable.OBJECTS.items():
        module, qualname = path.split(":")
        assert _stable.named(name) is getattr(importlib.import_module(module), qualname), name
    for new in _stable.MOVED.values():
        importlib.import_module(f"torch_precompile.{new}")
    with pytest.raises(LookupError, match="written by a newer one; upgrade torch_precompile"):
        _stable.named("no-such-name")
