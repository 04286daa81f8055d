"""Each step of the artifact's call path (``torch_precompile.runtime.steps``), printed as code."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from ...guards import AutogradGuard, Guard, describe_source
from ..steps import CheckGuards, CheckHooks, CheckIdentities, CheckIndices
from ._names import Emitter, Names, f_locals_expr, is_model_side, source_expr
from ._output import Output

if TYPE_CHECKING:
    from ..artifact import PrecompiledArtifact


def _emit_guard(e: Emitter, g: Guard, read: Any, indent: int, where: str) -> bool:
    """A guard's own Python form, or a comment saying where it is checked instead."""
    lines = g.python(read)
    e(f"# [{g.phase}] {g.expr}", indent)
    if lines is None:
        e(f"#   (checked by {where})", indent)
        return False
    for line in lines:
        e(line, indent)
    return True


def emit_model_checks(e: Emitter, artifact: PrecompiledArtifact, names: Names) -> None:
    """Guards on the model's tensors and attributes (and closure variables), checked at import."""
    e("")
    e("")
    e("def _check_model() -> None:")
    e('"""Guards on the model\'s weights and attributes (and closure variables).', 1)
    e("", 0)
    e("They come from the artifact file, not from a call, so they are checked once, at import.", 1)
    e('"""', 1)
    emitted = 0
    for g in artifact.guards:
        if g.kind in ("tensor", "value") and is_model_side(g.subject, names):
            tables = g.kind == "tensor"
            read = lambda text, tables=tables: source_expr(text, names, tables)  # noqa: E731
            emitted += _emit_guard(e, g, read, 1, "the guard tree in forward()")
    if not emitted:
        e("return None", 1)
    e("")
    e("")
    e("_check_model()")


def emit_grad_mode(e: Emitter, artifact: PrecompiledArtifact, names: Names, call_args: str) -> None:
    e.section("grad mode [aot_autograd]")
    for g in artifact.guards:
        if g.kind in ("autograd", "requires_grad"):
            e(f"# {g.expr}", 1)
    if artifact.training:
        e("if not torch.is_grad_enabled():", 1)
        e(f"raise GuardError({AutogradGuard.TRAINING_UNDER_NO_GRAD + ' [aot_autograd]'!r})", 2)
        return
    if artifact.runtime.grad_enabled:
        e("if not torch.is_grad_enabled():", 1)
        e("# Runs in the grad mode it was captured in; nothing requires grad, so the", 2)
        e("# result is eager's either way.", 2)
        e("with torch.enable_grad():", 2)
        e(f"return forward({call_args})", 3)
        return
    e("if torch.is_grad_enabled():", 1)
    e("# Captured under torch.no_grad(). Nothing may require grad; then running", 2)
    e("# without autograd, as captured, gives eager's result.", 2)
    checks = []
    if names.forward:
        checks.append((f"any_requires_grad([{', '.join(names.forward)}])", "an input"))
    checks.append(("any(p.requires_grad for p in PARAMS.values())", "a parameter of the model"))
    for cond, culprit in checks:
        e(f"if {cond}:", 2)
        message = AutogradGuard.inference_under_grad(culprit) + " [aot_autograd]"
        e(f"raise GuardError({message!r})", 3)
    e("with torch.no_grad():", 2)
    e(f"return forward({call_args})", 3)


def _emit_hooks(e: Emitter, step: CheckHooks, names: Names) -> None:
    e.section("module hooks [dynamo]")
    if step.guard is not None:
        e(f"# {step.guard.expr}", 1)
    e(f"PARTS.check_hooks({f_locals_expr(names)})", 1)


def _emit_guards(e: Emitter, step: CheckGuards, names: Names) -> None:
    e.section("guards: global state and inputs")
    manager = "the guard tree below"
    read = lambda text: source_expr(text, names)  # noqa: E731
    temp = 0
    for g in step.guards:
        if g.kind == "global":
            _emit_guard(e, g, read, 1, manager)
    for g in step.guards:
        if g.kind not in ("tensor", "value", "range", "shape"):
            continue
        if is_model_side(g.subject, names):
            continue
        expr = source_expr(g.subject, names) if g.subject else None
        if expr is not None and not expr.isidentifier():
            # A nested input (args[0], batch['x']): a missing entry breaks the guard too.
            name = f"value{temp}"
            temp += 1
            e("try:", 1)
            e(f"{name} = {expr}", 2)
            e("except (IndexError, KeyError, TypeError):", 1)
            e(f"raise GuardError({g.missing_message()!r}) from None", 2)
            _emit_guard(e, g, lambda _t, name=name: name, 1, manager)
        else:
            _emit_guard(e, g, read, 1, manager)
    e.section("guards: the rest of PyTorch's guard tree")
    e("# Strides, aliasing between inputs, module structure and attributes. Failures", 1)
    e("# are explained in the words of the guards above.", 1)
    if tree_source(step) is not None:
        e("seen, T = {}, []  # values recorded for the aliasing check, tensors collected", 1)
        e("try:", 1)
        e(f"ok = _guard_tree({f_locals_expr(names)}, seen, T)", 2)
        e("except (KeyError, AttributeError, TypeError, IndexError, ValueError):", 1)
        e("ok = False", 2)
        e("if not (ok and PARTS.tree_collected_ok(seen, T)):", 1)
        e(f"PARTS.explain({f_locals_expr(names)})", 2)
    else:
        e("# (Dynamo's own guard manager: this artifact has no plain-Python translation)", 1)
        e(f"PARTS.check_structure({f_locals_expr(names)})", 1)
    noted = [g for g in step.guards if g.kind in ("system", "structure", "dropped")]
    if noted:
        e.section("guards checked elsewhere")
        for g in noted:
            where = {
                "system": "Precompile.load, at import",
                "structure": "the guard tree above",
                "dropped": "no one (PyTorch cannot save them)",
            }[g.kind]
            e(f"# [{g.phase}] {g.expr}  -- checked by {where}", 1)


def tree_source(step: CheckGuards) -> str | None:
    """The guard tree's plain-Python source (a lean load's translation), or None."""
    light = getattr(step.guard_manager, "lean_guards", None)
    return getattr(light, "source", None)


def emit_guard_tree(e: Emitter, step: CheckGuards) -> None:
    """The guard tree as a module-level function ``_guard_tree(L, seen, T)``."""
    source = tree_source(step)
    if source is None:
        return
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    e("")
    e("")
    e("# PyTorch's guard tree as plain Python: the lean load's translation of Dynamo's")
    e("# guard manager, walking the model and the arguments as the C++ manager does.")
    e("# Its constants (k0, k1, ...) are rebuilt from the artifact file.")
    e(f"if PARTS.tree is None or PARTS.tree_digest() != {digest!r}:")
    e(
        'raise ImportError("the artifact loaded here without this guard tree: '
        'call to_python() again")',
        1,
    )
    e("globals().update(PARTS.tree.namespace)")
    for line in source.rstrip().splitlines():
        e(line.replace("def lean_check(L, seen, T):", "def _guard_tree(L, seen, T):"))


def _emit_entries(e: Emitter, title: str, entries: list[Guard], names: Names, where: str) -> None:
    """A section of guards printed in their own Python form (nothing when empty)."""
    if not entries:
        return
    e.section(title)
    read = lambda text: source_expr(text, names)  # noqa: E731
    for g in entries:
        _emit_guard(e, g, read, 1, where)


def _emit_identities(e: Emitter, step: CheckIdentities, names: Names) -> None:
    entries = [g for g, _ in step.identities.local]
    title = "identities of the functions the traced code called [dynamo]"
    _emit_entries(e, title, entries, names, "Precompile.load (globals are checked once)")


def _emit_indices(e: Emitter, step: CheckIndices, names: Names) -> None:
    entries = [g for _, g in step.indices.checks]
    title = "index inputs in range, IndexError as eager [inductor]"
    _emit_entries(e, title, entries, names, "the kernels (CUDA asserts)")


STEP_EMITTERS: dict[type, Any] = {
    CheckHooks: _emit_hooks,
    CheckGuards: _emit_guards,
    CheckIdentities: _emit_identities,
    CheckIndices: _emit_indices,
}


def emit_extraction(
    e: Emitter, sources: list[str], exprs: list[str | None], explicit: bool
) -> None:
    e.section("argument extraction: the compiled graph's inputs, in order")
    if explicit:
        e("# Checked when the artifact was built: on the example call, these sources gave", 1)
        e("# exactly the tensors Dynamo's bytecode passed to the compiled graph.", 1)
    width = max((len(x or "") for x in exprs), default=0)
    name_width = len(f"arg{len(exprs) - 1}")
    for i, (src, expr) in enumerate(zip(sources, exprs)):
        comment = f"# {describe_source(src)}  <- {src}"
        if explicit:
            e(f"{'arg' + str(i):<{name_width}} = {expr:<{width}}  {comment}", 1)
        else:
            e(f"# arg{i} = {expr or src}  {comment}", 1)


def emit_call_and_output(
    e: Emitter,
    artifact: PrecompiledArtifact,
    observed: Output,
    explicit: bool,
    names: Names,
    call_args: str,
) -> None:
    n = len(artifact.signature.graph_inputs or [])
    args = ", ".join(f"arg{i}" for i in range(n))
    e.section("the compiled call")
    if explicit:
        e(f"graph_out = COMPILED_GRAPH({args})", 1)
        e.section("output reconstruction")
        e(f"# {observed.description}", 1)
        e(f"return {observed.code}", 1)
        return
    why = observed.why_not or "an input source has no plain-code form"
    e(f"# graph_out = COMPILED_GRAPH({args})", 1)
    e.section("output reconstruction")
    e(f"# The output is rebuilt by Dynamo's bytecode, not by plain code here: {why}.", 1)
    e("# That bytecode does the argument extraction and the compiled call shown above itself.", 1)
    self_arg = "MODEL, " if names.self_name else ""
    e(f"return PARTS.dynamo_fn({self_arg}{call_args})", 1)
