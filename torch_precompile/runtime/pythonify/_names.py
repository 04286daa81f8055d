"""How generated code names things: the module's globals, an emitter, sources as code."""

from __future__ import annotations

import dataclasses
import keyword
import re

from ...guards import Source
from ...guards._source import MODULE_TABLES

MODULE_NAMES = frozenset(
    [
        "torch", "GuardError", "Identity", "parts_of", "plain", "dtype_name", "identity_of",
        "describe_identity", "global_state", "autocast_enabled", "any_requires_grad", "Precompile",
        "ARTIFACT", "ARTIFACT_PATH", "PARTS", "MODEL", "PARAMS", "BUFFERS", "CLOSURE", "GLOBALS",
        "COMPILED_GRAPH", "DEFAULTS", "forward", "graph_out", "lo", "hi", "seen", "T", "ok",
        "_guard_tree", "tf_stack_len", "top_hooks", "utils_device",
    ]
)  # fmt: skip
LOCAL_NAME = re.compile(r"(arg|value|s|k|v)\d+")


@dataclasses.dataclass
class Names:
    self_name: str | None
    forward: list[str]  # the forward's parameter names (self excluded)
    closure: set[str]


class Emitter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "", indent: int = 0) -> None:
        self.lines.append(("    " * indent + line) if line else "")

    def section(self, title: str, indent: int = 1) -> None:
        self("")
        self(f"# ---- {title} " + "-" * max(0, 72 - len(title)), indent)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def model_path(source: Source) -> str:
    """``.blocks._modules['0'].eps``: attribute access where the name allows it."""
    out = []
    steps = list(source.steps)
    i = 0
    while i < len(steps):
        kind, key = steps[i]
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        name = str(nxt[1]) if nxt is not None else ""
        if kind == "attr" and key in MODULE_TABLES and nxt and nxt[0] == "item" and _is_name(name):
            out.append(f".{name}")
            i += 2
            continue
        out.append(f".{key}" if kind == "attr" else f"[{key!r}]")
        i += 1
    return "".join(out)


def _is_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def source_expr(text: str, names: Names, tables: bool = True) -> str | None:
    """Code reading a Dynamo source inside the generated module, or None.

    With ``tables``, parameters and buffers read as ``PARAMS[name]`` /
    ``BUFFERS[name]``; without, through the module (a guard may say a
    parameter is None, which has no entry in the tables).
    """
    source = Source.parse(text)
    if source is None:
        return None
    if not source.is_local:
        return "GLOBALS" + str(source)[1:]
    weight = source.weight() if source.root == names.self_name else None
    if tables and weight is not None:
        return f"{'PARAMS' if weight[0] == 'parameters' else 'BUFFERS'}[{weight[1]!r}]"
    if source.root == names.self_name:
        return "MODEL" + model_path(source)
    if source.root in names.forward:
        return source.root + source.rest
    if source.root in names.closure:
        return f"CLOSURE[{source.root!r}]" + source.rest
    return None


def is_model_side(text: str | None, names: Names) -> bool:
    """Whether a guard reads the model or a closure (fixed by the file), not a call's input."""
    source = Source.parse(text) if text else None
    return (
        source is not None
        and source.is_local
        and (source.root == names.self_name or source.root in names.closure)
    )


def f_locals_expr(names: Names) -> str:
    items = [f"{names.self_name!r}: MODEL"] if names.self_name else []
    items.extend(f"{n!r}: {n}" for n in names.forward)
    return "{" + ("**CLOSURE, " if names.closure else "") + ", ".join(items) + "}"
