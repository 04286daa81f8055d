"""The lean format's schema (``lean/schema.py``, ``lean/guard_schema.py``) is its one
spelling: no stored key is written in two modules of the format, a real file's
section and guard tree read back to the form the file stores (the same keys, in the
same order), and what earlier versions wrote is read with its defaults or refused
with a clear error.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.models import build_tiny_mlp
from torch_precompile import Precompile
from torch_precompile import file as container
from torch_precompile.file import sections
from torch_precompile.lean import schema
from torch_precompile.lean.guard_schema import GuardTree
from torch_precompile.lean.guards import LeanGuards

PACKAGE = Path(schema.__file__).resolve().parents[1]
SCHEMA = {PACKAGE / "lean" / "schema.py", PACKAGE / "lean" / "guard_schema.py"}
# The lean format's modules: its reader (lean/, the stand-ins aside, which have their
# own records) and its writer.
FORMAT = sorted(
    p
    for folder in ("lean", "lean_writer")
    for p in (PACKAGE / folder).glob("*.py")
    if p.name != "__init__.py"
)


def _keys(path: Path) -> set[str]:
    """The strings ``path`` spells as a key: ``d["k"]``, ``d.get("k")``, ``{"k": ...}``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        candidates: list[Any] = []
        if isinstance(node, ast.Subscript):
            candidates = [node.slice]
        elif isinstance(node, ast.Dict):
            candidates = [k for k in node.keys if k is not None]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
        ):
            candidates = [node.args[0]]
        found.update(
            c.value for c in candidates if isinstance(c, ast.Constant) and type(c.value) is str
        )
    return found


def test_no_stored_key_is_spelled_in_two_modules() -> None:
    by_module = {path: _keys(path) for path in FORMAT}
    schema_keys = set().union(*(by_module[p] for p in SCHEMA))
    # The schema's keys are those of the section and its records (the check reads them).
    assert {"lean_guards", "pycode", "prepared", "cubin", "entries", "shape_guards"} <= schema_keys
    # Each is spelled there, in one of its two modules, and nowhere else.
    spellers = {key: _spellers(key) for key in schema_keys}
    assert all(len(v) == 1 for v in spellers.values()), spellers


# The same words as keys of other dicts, not of the stored form.
NOT_STORED = {
    ("guard_types.py", "dict"),  # LEAN_TYPES: the type a ``type`` leaf names
    ("guard_leaves.py", "size"),  # Dynamo's tensor metadata, read at save
    ("guards.py", "torch"),  # the check's namespace
    ("specs.py", "extern_kernels"),  # the wrapper's global of that name (a probe's namespace)
    ("wrapper.py", "extern_kernels"),  # the same, at load
}
# A leaf is a list (``[kind, *arguments]``); the dicts some leaves hold are the schema's too.


def _spellers(key: str) -> list[str]:
    """The format's modules that spell ``key`` as a key of the stored form."""
    return sorted(p.name for p in FORMAT if key in _keys(p) and (p.name, key) not in NOT_STORED)


def _stored_keys(value: Any) -> set[str]:
    """The keys of every dict in ``value`` (a stored form: dicts and lists)."""
    if isinstance(value, dict):
        return {str(k) for k in value}.union(*(_stored_keys(v) for v in value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(_stored_keys(v) for v in value))
    return set()


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The stored form of the lean section of an inference, a dynamic and a training file."""
    tmp = tmp_path_factory.mktemp("lean-schema")
    model, (x,), _ = build_tiny_mlp()
    with torch.no_grad():
        Precompile.save(tmp / "inference.pt2", Precompile.compile(model, x))
        xd = x.clone()
        torch._dynamo.mark_dynamic(xd, 0, min=2, max=64)
        Precompile.save(tmp / "dynamic.pt2", Precompile.compile(model, xd))
    train = build_tiny_mlp()[0].train()
    Precompile.save(tmp / "training.pt2", Precompile.compile(train, x.clone().requires_grad_()))
    return {
        name: pickle.loads(container.read_artifact(tmp / f"{name}.pt2")[1][sections.LEAN])
        for name in ("inference", "dynamic", "training")
    }


def _same_form(a: Any, b: Any) -> None:
    """Equal, and every dict with its keys in the same order."""
    assert a == b
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_form(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            _same_form(x, y)


@pytest.mark.parametrize("name", ["inference", "dynamic", "training"])
def test_a_saved_section_reads_back_to_its_stored_form(
    stored: dict[str, dict[str, Any]], name: str
) -> None:
    data = stored[name]
    section = schema.LeanSection.read(data)
    assert (section.backward is not None) == (name == "training")
    assert (section.inference is not None) == (name != "training")
    _same_form(section.write(), data)
    tree = pickle.loads(data["lean_guards"])
    read = GuardTree.read(tree)
    assert bool(read.shape_guards) == (name == "dynamic")
    _same_form(read.write(), tree)
    # Every key the file holds is spelled by one module: the schema's records, or
    # pycode.py's compiled code (its write and read side by side). The dicts keyed by
    # data (globals' aliases, kernels' keys, keyword defaults) are left out.
    data_keyed = dict.fromkeys(("import_sources", "global_homes", "triton", "kwdefaults"))
    keys = _stored_keys({**data, **data_keyed, "lean_guards": tree})
    spellers = {key: _spellers(key) for key in keys}
    assert spellers["guards_state"] == ["schema.py"] and spellers["magic"] == ["pycode.py"]
    assert {k: v for k, v in spellers.items() if len(v) > 1} == {}, spellers
    # The tree read back is the check the file's saved emission is of.
    saved = LeanGuards(data["lean_guards"], section.pycode.guards, section.pycode.prepared)
    assert LeanGuards(read).source == saved.source


def test_an_older_section_reads_with_its_defaults(stored: dict[str, dict[str, Any]]) -> None:
    """A file before each optional field (format 2's ``light_guards``, no inference spec,
    no compiled code, no hook guards) reads as those files meant."""
    old = dict(stored["inference"])
    optional = ("inference", "pycode", "hook_guards", "device_type", "triton", "cudagraphs",
                "mutated_inputs", "global_homes", "used_global_names", "external_refs")  # fmt: skip
    for key in optional:
        del old[key]
    old["light_guards"] = old.pop("lean_guards")
    section = schema.LeanSection.read(old)
    assert section.lean_guards == stored["inference"]["lean_guards"]
    assert (section.inference, section.hook_guards, section.device_type) == (None, False, "cpu")
    assert section.pycode == schema.CompiledPython() and section.triton == {}
    assert section.mutated_inputs == () and section.global_homes == {}


@pytest.mark.parametrize(
    ("part", "change"),
    [
        ("", {"version": schema.LEAN_SECTION_VERSION + 1}),
        ("", {"torch": "0.0.0"}),
        ("inference", {"version": schema.RUNTIME_SPEC_VERSION + 1}),
    ],
)
def test_another_versions_section_is_refused(
    stored: dict[str, dict[str, Any]], part: str, change: dict[str, Any]
) -> None:
    data = dict(stored["inference"])
    if part:
        data[part] = {**data[part], **change}
    else:
        data.update(change)
    with pytest.raises(ValueError, match="written by another version"):
        schema.LeanSection.read(data)


def test_another_versions_backward_and_triton_launch_are_refused(
    stored: dict[str, dict[str, Any]],
) -> None:
    data = dict(stored["training"])
    data["backward"] = {**data["backward"], "version": schema.AUTOGRAD_SPEC_VERSION + 1}
    with pytest.raises(ValueError, match="lean backward was written by another version"):
        schema.LeanSection.read(data)
    launch = {
        "name": "k", "launcher": b"", "defaults": None, "num_warps": 4, "shared": 0,
        "arg_tys": "", "scratch": 0, "device": 0, "profile_name": "k",
    }  # fmt: skip
    assert schema.TritonLaunch.read(launch, "key").cubin == "key"  # before cubins were named
    with pytest.raises(ValueError, match="Triton kernel spec was written by another version"):
        schema.TritonLaunch.read({**launch, "version": schema.TRITON_SPEC_VERSION + 1}, "key")
