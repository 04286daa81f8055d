"""The private PyTorch names torch_precompile uses, checked on the installed torch.

``torch_precompile/_compat/contract.py`` lists every private name ``_compat/``
touches. On a new PyTorch, ``test_every_private_name_resolves`` reports each
one that is missing or changed, all in one message. The layout tests keep
the list complete: a private ``torch`` name (a path with a ``_``-prefixed
part) referenced in ``_compat/`` source, or a keyword or config key passed to
one, must be in the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

from torch_precompile._compat import contract, contract_check
from torch_precompile._compat.contract import PrivateName
from torch_precompile.lean.wrapper import WRAPPER_IMPORTS

COMPAT = Path(contract.__file__).parent
PACKAGE = COMPAT.parent
# The two folders that may touch private torch names: the save-time adapters and the
# lean runtime (tests/test_layout.py keeps every other module free of them).
PRIVATE_ROOTS = (COMPAT, PACKAGE / "lean", PACKAGE / "lean_writer")
_TENSOR_GUARDS_PROBE = "TensorGuards(*tensors, dynamic_dims_sizes=, dynamic_dims_strides=)"


def test_every_private_name_resolves() -> None:
    found = contract_check.problems()
    assert not found, contract_check.report(found)


def test_missing_and_changed_names_are_all_reported_in_one_message() -> None:
    """A list with a bogus name, module, parameter and config key: each is named in the
    report (the check does not stop at the first), and the good entries are not."""
    names = (
        PrivateName("torch._inductor.codecache:PyCodeCache.load"),
        PrivateName("torch._inductor.codecache:NoSuchCache.load"),
        PrivateName("torch._dynamo.no_such_module:thing"),
        PrivateName(
            "torch._functorch.aot_autograd:aot_export_joint_with_descriptors",
            ("decompositions", "no_such_parameter"),
        ),
        PrivateName("torch._inductor.config", ("triton.cudagraphs", "no_such.config_key")),
        PrivateName("torch.no_such_config", ("x",), alternatives=("torch._dynamo.config",)),
        # A C++ callable's keywords are checked by running our call: here on the wrong class.
        PrivateName("torch._C:_dynamo.guards.GlobalStateGuard", probe=_TENSOR_GUARDS_PROBE),
    )
    found = contract_check.problems(names)
    message = contract_check.report(found)
    assert len(found) == 6, message
    assert message.startswith("6 private PyTorch name(s)")
    for bogus in ("NoSuchCache", "no_such_module", "no_such_parameter", "no_such.config_key"):
        assert bogus in message
    # Reported as what it is: a missing attribute, a changed signature.
    assert "missing: torch._inductor.codecache:NoSuchCache.load (AttributeError" in message
    changed = "changed: torch._functorch.aot_autograd:aot_export_joint_with_descriptors has no"
    assert f"{changed} no_such_parameter" in message
    assert "GlobalStateGuard fails our call TensorGuards(" in message
    assert "PyCodeCache.load" not in message and "triton.cudagraphs" not in message
    # An entry with alternatives fails only when none of its places has what is used.
    assert "torch.no_such_config" in message and "torch._dynamo.config has no x" in message


def test_an_alternative_place_is_enough() -> None:
    names = (
        PrivateName(
            "torch.no_such_module", ("strict_autograd_cache",), ("torch._functorch.config",)
        ),
    )
    assert contract_check.problems(names) == []


def test_an_entry_is_checked_only_on_the_torches_that_have_it() -> None:
    """``since``: the first torch with the name; ``until``: the first without it (2.15
    removed ``_graph_device_type``). Outside its range an entry is not checked."""
    import torch

    gone = "torch._dynamo.no_such_module:thing"
    assert contract_check.problems((PrivateName(gone, until="2.0"),)) == []
    assert contract_check.problems((PrivateName(gone, since="99.0"),)) == []
    assert contract_check.problems((PrivateName(gone, until="99.0"),)) != []
    # Versions compare as versions: 2.15 is after 2.9 (not so as strings).
    assert contract_check.problems((PrivateName(gone, since="2.9"),)) != []
    entries = {e.name: e for e in contract.CONTRACT}
    old = entries["torch._dynamo.graph_utils:_graph_device_type"]
    new = entries["torch._dynamo.graph_utils:_graph_device_types"]
    assert (old.until, new.since) == ("2.15", "2.15")
    checked = torch.torch_version.TorchVersion(torch.__version__) >= (2, 15)
    assert contract_check.problems((new if checked else old,)) == []


# ------------------------------------------------------------------ layout


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _private(name: str) -> bool:
    parts = name.split(".")
    return (
        parts[0] == "torch"
        and parts[1:2] != ["ops"]
        and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])
    )


def _references() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Private torch names referenced in ``_compat/`` and ``lean/`` (name -> files), and
    the keywords or config keys passed to each (name -> keys)."""
    refs: dict[str, set[str]] = {}
    keys: dict[str, set[str]] = {}
    for path in sorted(p for root in PRIVATE_ROOTS for p in root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE).as_posix()  # lean/wrapper.py, _compat/capture.py
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("torch."):
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        aliases["torch"] = "torch"

        def full(node: ast.AST, aliases: dict[str, str] = aliases) -> str | None:
            dotted = _dotted(node)
            if dotted is None or dotted.split(".")[0] not in aliases:
                return None
            head, _, rest = dotted.partition(".")
            return f"{aliases[head]}.{rest}" if rest else aliases[head]

        for alias in aliases.values():
            if _private(alias):
                refs.setdefault(alias, set()).add(where)
        for node in ast.walk(tree):
            name = full(node) if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.Call):
                func = full(node.func)
                if func is not None and func.endswith(".patch"):
                    func = func[: -len(".patch")]  # a config module's patch: its keys
                if func is not None and _private(func):
                    used = {k.arg for k in node.keywords if k.arg}
                    for arg in node.args:
                        if isinstance(arg, ast.Dict):  # config.patch({"key": value})
                            used |= {k.value for k in arg.keys if isinstance(k, ast.Constant)}
                    keys.setdefault(func, set()).update(used)
                callee = _dotted(node.func) or ""
                if callee.endswith("import_module") and isinstance(node.args[0], ast.Constant):
                    name = node.args[0].value
            if name and _private(name):
                refs.setdefault(name, set()).add(where)
    for line in WRAPPER_IMPORTS:  # what Inductor's generated wrapper imports
        if line.startswith("from torch"):
            module, names = line[len("from ") :].split(" import ")
            for imported in names.split(","):
                name = f"{module}.{imported.split(' as ')[0].strip()}"
                refs.setdefault(name, set()).add("lean/wrapper.py (WRAPPER_IMPORTS)")
    return refs, keys


def _listed() -> dict[str, set[str]]:
    """Each listed name and place (``module.attr``), with the uses listed for it."""
    listed: dict[str, set[str]] = {}
    for entry in contract.CONTRACT:
        for place in entry.places():
            listed.setdefault(place.replace(":", "."), set()).update(entry.uses)
    return listed


def _covered(name: str, listed: dict[str, set[str]]) -> bool:
    if name in listed or any(other.startswith(name + ".") for other in listed):
        return True
    parent, _, last = name.rpartition(".")
    if last.startswith("__") or last == "patch":
        return parent in listed or any(other.startswith(parent + ".") for other in listed)
    return last in listed.get(parent, ())  # a config key or member listed as a use


def test_the_layout_test_finds_what_it_must() -> None:
    refs, keys = _references()
    # One of each kind: an import, an alias chain, a torch._C chain, a wrapper import,
    # an import_module string, and the keys of a config patch.
    for name in (
        "torch._inductor.codecache.CppPythonBindingsCodeCache",
        "torch._inductor.compile_fx.partition_fn",
        "torch._C._dynamo.guards.assert_size_stride",
        "torch._inductor.runtime.runtime_utils.assert_tensor_metadata",
        "torch.distributed._ops.device_mesh",
    ):
        assert name in refs, name
    # Both folders are read: the lean runtime's private names are named by their file.
    assert "lean/wrapper.py" in refs["torch._C._dynamo.guards.assert_size_stride"]
    assert "force_autograd_cache" in keys["torch._functorch.config"]
    assert _covered("torch._inductor.compile_fx.partition_fn", _listed())
    assert not _covered("torch._inductor.compile_fx.no_such_name", _listed())


def test_every_private_name_in_compat_is_in_the_contract() -> None:
    refs, _ = _references()
    listed = _listed()
    absent = sorted(
        f"{name} (in {', '.join(sorted(refs[name]))})"
        for name in refs
        if not _covered(name, listed)
    )
    assert not absent, "add to CONTRACT in _compat/contract.py:\n  " + "\n  ".join(absent)


def test_every_keyword_and_config_key_passed_is_in_the_contract() -> None:
    _, keys = _references()
    listed = _listed()
    absent = sorted(
        f"{name}: {key}"
        for name, used in keys.items()
        for key in used
        if key not in listed.get(name, ())
    )
    assert not absent, "add these uses to CONTRACT in _compat/contract.py:\n  " + "\n  ".join(
        absent
    )


def test_no_entry_is_listed_twice() -> None:
    names = [entry.name for entry in contract.CONTRACT]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# ------------------------------------------------- members and private attributes

# Private attributes torch reads off objects, also read in lean/standin/module.py.
_MEMBER_FILES = (
    *sorted(COMPAT.rglob("*.py")),
    *sorted((COMPAT.parent / "lean_writer").rglob("*.py")),
    COMPAT.parent / "lean" / "standin" / "module.py",
)


def _own_names() -> set[str]:
    """Names the package defines itself: functions, classes, its own attributes."""
    own: set[str] = set()
    for path in COMPAT.parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    return own


def _member_reads() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Members read off objects in ``_compat/`` and lean/standin/module.py: those of a
    :data:`contract.RECEIVERS` variable (variable -> members), and every private one
    (``x._name``, ``getattr(x, "_name")``) not the package's own (name -> files)."""
    own = _own_names()
    received: dict[str, set[str]] = {}
    private: dict[str, set[str]] = {}
    for path in _MEMBER_FILES:
        where = path.relative_to(COMPAT.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                base, attr = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                base, attr = node.args[0], node.args[1].value
            else:
                continue
            if isinstance(base, ast.Name) and base.id in contract.RECEIVERS:
                received.setdefault(base.id, set()).add(attr)
            dotted = _dotted(base) or ""
            if (
                attr.startswith("_")
                and not attr.startswith("__")
                and not attr.startswith("_torch_precompile")
                and dotted not in ("self", "cls")
                and dotted.split(".")[0] != "torch"  # module chains: the test above
                and attr not in own
            ):
                private.setdefault(attr, set()).add(where)
    return received, private


def _uses_of(name: str) -> set[str]:
    return {
        one for e in contract.CONTRACT if e.name == name for use in e.uses for one in use.split("|")
    }


def test_the_member_scan_finds_what_it_must() -> None:
    received, private = _member_reads()
    assert "_maybe_evaluate_static" in received["shape_env"]
    assert "_aot_graph_capture" in received["jd"]
    for name in ("_tracer_cls", "_dynamo_dynamic_indices", "_global_forward_hooks", "_is_static"):
        assert name in private, name
    assert "lean/standin/module.py" in private["_non_persistent_buffers_set"]
    assert "_fail_unless" not in private  # the package's own
    assert "_ShapeEnv_nothing" not in _uses_of("torch.fx.experimental.symbolic_shapes:ShapeEnv")


def test_every_member_of_a_private_object_is_in_the_contract() -> None:
    received, _ = _member_reads()
    absent = sorted(
        f"{contract.RECEIVERS[var]}: {attr} (read off {var})"
        for var, attrs in received.items()
        for attr in attrs
        if attr not in _uses_of(contract.RECEIVERS[var])
    )
    assert not absent, "add these uses to CONTRACT in _compat/contract.py:\n  " + "\n  ".join(
        absent
    )


def test_every_private_attribute_read_is_in_the_contract() -> None:
    _, private = _member_reads()
    entries = contract.CONTRACT
    listed = {u for e in entries for use in (*e.uses, *e.attrs) for u in use.split("|")}
    listed |= {p.rpartition(":")[2].rpartition(".")[2] for e in entries for p in e.places()}
    absent = sorted(
        f"{name} (in {', '.join(sorted(private[name]))})" for name in private if name not in listed
    )
    assert not absent, "add to CONTRACT in _compat/contract.py:\n  " + "\n  ".join(absent)


def test_every_run_time_attribute_has_a_probe() -> None:
    unchecked = [
        e.name for e in contract.CONTRACT if e.attrs and e.probe not in contract_check.PROBES
    ]
    assert not unchecked, unchecked


def test_a_member_of_a_class_is_not_taken_for_a_constructor_keyword() -> None:
    """ShapeEnv's constructor takes ``**kwargs``: a member it lacks is still reported;
    ``"a|b"`` is met by either."""
    shape_env = "torch.fx.experimental.symbolic_shapes:ShapeEnv"
    found = contract_check.problems((PrivateName(shape_env, ("no_such_member",)),))
    assert found == [f"changed: {shape_env} has no no_such_member"]
    assert contract_check.problems((PrivateName(shape_env, ("no_such_member|guards",)),)) == []


def test_the_source_grammar_probe_fails_on_a_grammar_change(monkeypatch) -> None:
    """Dynamo's guard sources of a tiny capture parse; a source form the grammar does
    not know (here: pretend module items are new) is reported by name."""
    from torch_precompile.guards import _source

    entry = next(e for e in contract.CONTRACT if e.probe == "guard source strings")
    assert contract_check.problems((entry,)) == []
    parse = _source.Source.parse.__func__

    def without_module_items(cls: type, text: str) -> _source.Source | None:
        return None if "._modules[" in text else parse(cls, text)

    monkeypatch.setattr(_source.Source, "parse", classmethod(without_module_items))
    (line,) = contract_check.problems((entry,))
    assert "guard source strings our grammar does not read" in line
    assert "L['self']._modules['lin']" in line
