"""The docs against what they describe: links that resolve, the README's commands as
CI runs them, and docs/ARCHITECTURE.md's layers as tests/test_layout.py keeps them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.test_layout import LAYERS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS.append(ROOT / "benchmarks" / "results" / "README.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> list[str]:
    """The lines of a markdown file outside its code fences."""
    lines, fence = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings (a repeated heading gets -1, -2...)."""
    seen: dict[str, int] = {}
    for line in _prose(path):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            base = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            seen[base] = seen.get(base, -1) + 1
            if seen[base]:
                seen[f"{base}-{seen[base]}"] = 0
    return set(seen)


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall("\n".join(_prose(doc))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _readme_commands() -> list[list[str]]:
    """The README's bash blocks' commands, each split into words."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            commands += [shlex.split(part) for part in line.split(" && ") if part.strip()]
    return commands


def test_readme_setup_is_what_ci_runs() -> None:
    """CI's first stage runs the README's two set-up commands, in order, and its test
    command; CI adds --quiet and its own checks (python -c) only."""
    ci = (ROOT / ".ci" / "run").read_text()
    stage = ci[ci.index('echo "=== torch 2.13.0') : ci.index('end_stage "torch 2.13.0"')]
    ran = []
    for line in stage.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] in (["pip"], ["python"]) and words[:2] != ["python", "-c"]:
            ran.append([w for w in words if w != "--quiet"])
    assert ran, "no pip or python command in .ci/run's torch 2.13.0 stage"
    readme = _readme_commands()
    assert readme[: len(ran)] == ran, f"README: {readme[: len(ran)]}\nCI: {ran}"


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_architecture_layers_are_the_layout_tests() -> None:
    """docs/ARCHITECTURE.md's layer table: the units of tests/test_layout.py's LAYERS,
    layer by layer (``__main__``, the last layer, left out)."""
    lines = _prose(ROOT / "docs" / "ARCHITECTURE.md")
    start = lines.index("## Layers")
    rows = [ln for ln in lines[start:] if re.match(r"\| \d+ \|", ln)]
    written = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[1])
        units = tuple(n.removesuffix("/").removesuffix(".py") for n in names)
        written.append((int(cells[0]), units))
    expected = [(i, units) for i, units in enumerate(LAYERS) if "__main__" not in units]
    assert written == expected
