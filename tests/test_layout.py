"""The package's layout: layers that import only downward, a lean runtime that
imports no compiler, a torch-free file container, private torch names in two
folders only, no import cycles, and modules of a readable size.

Reads the source (no import). Every import counts, at module level or inside a
function; those under ``if TYPE_CHECKING:`` (type hints only) do not.
docs/ARCHITECTURE.md explains the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torch_precompile"
MAX_LINES = 400
# Modules over MAX_LINES while they are split, with the size they may not pass.
SPLITTING = {"torch_precompile.runtime.generator": 460}

# Bottom to top: a unit may import units of lower layers (and itself) only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_errors", "_stable"),
    ("file",),  # the container: bytes, header JSON, checksums; no torch
    ("lean",),  # the runtime without the compiler
    ("_compat",),  # adapters over PyTorch's private APIs
    ("lean_writer",),  # the lean format's writer: reads what the compiler built
    ("guards",),
    ("engine",),  # decoding a generator's step: scheduler, runner, output stage; no HTTP
    ("runtime",),  # an artifact's call path
    ("distributed",),
    ("stages", "serialization"),  # build an artifact; save and load one
    ("__init__",),  # the public API: the Precompile facade, its types, the errors
    ("serve",),  # the OpenAI-compatible server over a generator file
    ("generation", "encoding"),  # model libraries
    ("cli",),  # the command line (its build --generator drives generation/)
    ("__main__",),
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# What the lean runtime may not import: the compiler (Inductor outside the runtime
# subpackage its generated code imports, AOTAutograd, sympy) and Dynamo outside the
# guard manager it rebuilds when its own guards cannot decide.
COMPILER = ("torch._dynamo", "torch._inductor", "torch._functorch", "sympy")
COMPILER_ALLOWED = ("torch._inductor.runtime",)
DYNAMO_FALLBACK = {
    "dynamo_fallback.py": {"hook_guards_enabled", "load_dynamo_guard_manager"},
    "compiled_function.py": {"__call__"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def _imports(name: str, path: Path, modules: dict[str, Path], *, top_level_only: bool = False):
    """(imported module, enclosing function or None) for each import in ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if id(child) in skipped:
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not top_level_only:
                    visit(child, child.name)
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    target = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    target = child.module or ""
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in modules else target, function))
            elif isinstance(child, ast.Import):
                found.extend((a.name, function) for a in child.names)
            visit(child, function)

    visit(tree, None)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return _modules()


def test_every_unit_has_a_layer(modules: dict[str, Path]) -> None:
    units = {_unit(m) for m in modules}
    assert not units - set(LAYER), f"place these in LAYERS: {sorted(units - set(LAYER))}"
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert len(top) <= 20, sorted(top)


def test_imports_run_downward(modules: dict[str, Path]) -> None:
    upward = []
    for name, path in modules.items():
        for target, function in _imports(name, path, modules):
            if not target.startswith("torch_precompile") or target == "torch_precompile":
                continue
            here, there = _unit(name), _unit(target)
            if here != there and LAYER[there] >= LAYER[here]:
                where = f"{name}" + (f" ({function})" if function else "")
                upward.append(f"{where} -> {target}")
    assert not upward, "imports that do not run downward:\n  " + "\n  ".join(sorted(upward))
    # The check reads what it must: imports inside functions are seen too.
    inner = [
        (name, target)
        for name, path in modules.items()
        for target, function in _imports(name, path, modules)
        if function is not None and target.startswith("torch_precompile")
    ]
    assert inner


def test_lean_runtime_imports_no_compiler(modules: dict[str, Path]) -> None:
    bad = []
    for name, path in modules.items():
        if _unit(name) != "lean":
            continue
        allowed = DYNAMO_FALLBACK.get(path.name, set())
        for target, function in _imports(name, path, modules):
            compiler = target.startswith(COMPILER) and not target.startswith(COMPILER_ALLOWED)
            fallback = target.startswith("torch._dynamo") and function in allowed
            if compiler and not fallback:
                bad.append(f"{name} ({function or 'module level'}) imports {target}")
    assert not bad, "\n".join(bad)


def test_file_container_is_torch_free(modules: dict[str, Path]) -> None:
    for name, path in modules.items():
        if _unit(name) == "file":
            imported = [t for t, _ in _imports(name, path, modules)]
            assert not [t for t in imported if t == "torch" or t.startswith("torch.")], name


def _private_torch_names(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [ast.unparse(node)]
        for n in names:
            parts = n.split(".")
            if parts[0] == "torch" and any(
                p.startswith("_") and not p.startswith("__") for p in parts[1:]
            ):
                found.add(n)
    return found


def test_private_torch_names_only_in_compat_and_lean_folders(modules: dict[str, Path]) -> None:
    outside = {
        name: sorted(_private_torch_names(ast.parse(path.read_text())))
        for name, path in modules.items()
        if _unit(name) not in ("_compat", "lean", "lean_writer")
    }
    outside = {k: v for k, v in outside.items() if v}
    assert not outside, outside


def test_no_import_cycles(modules: dict[str, Path]) -> None:
    graph = {
        name: {
            t
            for t, _ in _imports(name, path, modules, top_level_only=True)
            if t in modules and t != name
        }
        for name, path in modules.items()
    }
    assert "torch_precompile._compat" in graph["torch_precompile.runtime.call"]  # graph is read
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError(
                "import cycle: " + " -> ".join([*stack[stack.index(name) :], name])
            )
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_modules_stay_readable(modules: dict[str, Path]) -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    too_long = {name: n for name, n in sizes.items() if n > SPLITTING.get(name, MAX_LINES)}
    assert not too_long, too_long
