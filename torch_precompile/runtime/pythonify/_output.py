"""The output reconstruction, as code, from the structure recorded at ``precompile``
(see :mod:`torch_precompile.runtime.signature`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...guards._python import literal as _literal
from ..signature import CallSignature, describe, first_opaque


@dataclasses.dataclass
class Output:
    """How the generated ``forward`` rebuilds the return value."""

    code: str | None  # from graph_out / argN, or None (Dynamo's bytecode rebuilds it)
    imports: list[str]
    why_not: str  # why the output is not rebuilt as plain code
    description: str  # the structure, in words
    inputs_checked: bool  # the extraction lines were checked to give the graph's inputs


def output_of(signature: CallSignature) -> Output:
    """The reconstruction recorded in an artifact's signature."""
    recorded = signature.output_structure
    if not isinstance(recorded, dict) or "value" not in recorded:
        why = "the artifact does not record its output structure (saved by an older version)"
        return Output(None, [], why, "?", False)
    tree = recorded["value"]
    description = describe(tree, signature.outputs or [])
    why = first_opaque(tree)
    if why is not None:
        return Output(None, [], why, description, False)
    imports: list[str] = []
    code = _code(tree, imports)
    checked = bool(recorded.get("inputs_checked"))
    if not checked:
        why = "the graph inputs' sources did not give the tensors the compiled graph received"
        return Output(None, [], why, description, False)
    return Output(code, imports, "", description, True)


def _class(path: str, imports: list[str]) -> str:
    module, _, qualname = path.partition(":")
    line = f"import {module}"
    if line not in imports:
        imports.append(line)
    return f"{module}.{qualname}"


def _code(tree: dict[str, Any], imports: list[str]) -> str:
    if "out" in tree:
        return f"graph_out[{tree['out']}]"
    if "in" in tree:
        return f"arg{tree['in']}"
    if "const" in tree:
        return _literal(tree["const"]) or repr(tree["const"])
    if "tuple" in tree:
        items = [_code(v, imports) for v in tree["tuple"]]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if "list" in tree:
        return "[" + ", ".join(_code(v, imports) for v in tree["list"]) + "]"
    if "namedtuple" in tree:
        cls = _class(tree["namedtuple"], imports)
        return f"{cls}({', '.join(_code(v, imports) for v in tree['items'])})"
    if "dataclass" in tree:
        cls = _class(tree["dataclass"], imports)
        fields = ", ".join(f"{k}={_code(v, imports)}" for k, v in tree["fields"])
        return f"{cls}({fields})"
    literal = "{" + ", ".join(f"{k!r}: {_code(v, imports)}" for k, v in tree["dict"]) + "}"
    return f"{_class(tree['class'], imports)}({literal})" if "class" in tree else literal
