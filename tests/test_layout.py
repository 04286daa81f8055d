"""The package's layout: no import cycles between its modules, and modules of a readable size.

Reads the source (no import): the graph of module-level imports between
``torch_precompile`` modules (imports under ``if TYPE_CHECKING:`` excluded) must
have no cycle, and no module may grow past the size the layout aims for.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torch_precompile"
MAX_LINES = 520


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports at module level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "torch_precompile._compat" in graph["torch_precompile._runtime"]  # the graph is read
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


def test_modules_stay_readable() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_long, too_long
