"""``PrecompiledArtifact.to_python``: the compiled runtime as a readable Python module.

In the spirit of PyTorch's "pythonify" (seed 003): the artifact's call path
(:mod:`torch_precompile._runtime`), printed step by step as plain Python:

1. grad mode, then each guard as ``if`` statements raising the guard's own
   message (the typed guards of :mod:`torch_precompile.guards` print them);
2. argument extraction: each graph input in order, and the parameter,
   buffer or input it is read from;
3. the call of the compiled graph with that flat list;
4. output reconstruction: the model's return value rebuilt from the flat
   graph outputs.

The generated module imports only :mod:`torch_precompile.pythonify.support`
and loads kernels and weights from the artifact file it names, once.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import keyword
import logging
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any

from .._runtime import CheckGuards, CheckHooks, CheckIdentities, CheckIndices
from ..guards import AutogradGuard, Guard, Source, describe_source
from ..guards._python import literal as _literal
from ._output import Output, output_of

if TYPE_CHECKING:
    from .._artifact import PrecompiledArtifact

log = logging.getLogger("torch_precompile")

# Names the generated forward() reads from its module, and the locals it defines.
_MODULE_NAMES = frozenset(
    [
        "torch", "GuardError", "Identity", "parts_of", "plain", "dtype_name", "identity_of",
        "describe_identity", "global_state", "autocast_enabled", "any_requires_grad", "Precompile",
        "ARTIFACT", "ARTIFACT_PATH", "PARTS", "MODEL", "PARAMS", "BUFFERS", "CLOSURE", "GLOBALS",
        "COMPILED_GRAPH", "DEFAULTS", "forward", "graph_out", "lo", "hi",
    ]
)  # fmt: skip
_LOCAL_NAME = re.compile(r"(arg|value|s)\d+")


# --------------------------------------------------------------- generator


@dataclasses.dataclass
class _Names:
    self_name: str | None
    forward: list[str]  # the forward's parameter names (self excluded)
    closure: set[str]


class _Emitter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "", indent: int = 0) -> None:
        self.lines.append(("    " * indent + line) if line else "")

    def section(self, title: str, indent: int = 1) -> None:
        self("")
        self(f"# ---- {title} " + "-" * max(0, 72 - len(title)), indent)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def write_module(
    artifact: PrecompiledArtifact,
    path: str | os.PathLike[str],
    artifact_path: str | os.PathLike[str] | None,
) -> str:
    """Generate the module for ``artifact`` and write it to ``path`` atomically."""
    target = artifact_path if artifact_path is not None else artifact._origin.get("path")
    if target is None:
        raise ValueError(
            "to_python() needs the artifact's file: the generated module loads kernels and weights "
            "from it. Save the artifact first (Precompile.save(path, artifact)) "
            "or pass artifact_path="
        )
    target = os.path.abspath(os.fspath(target))
    if not os.path.isfile(target):
        raise FileNotFoundError(
            f"artifact file {target!r} does not exist; save the artifact there first"
        )
    source = generate(artifact, target)
    path = os.fspath(path)
    compile(source, path, "exec")  # a generator bug must not leave a module that cannot import
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".to_python-", suffix=".py", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    log.info("to_python: wrote %s (%d lines) for %s", path, source.count("\n"), target)
    return source


def generate(artifact: PrecompiledArtifact, artifact_path: str) -> str:
    """The source of a module that runs ``artifact`` (loaded from ``artifact_path``)."""
    runtime = artifact._runtime
    signature: inspect.Signature = runtime.signature
    sources = artifact.signature.get("graph_inputs")
    if not sources:
        raise ValueError(
            "this artifact does not record where its graph inputs come from (written by an older "
            "torch_precompile or by torch's save_compiled_function); compile and save it again"
        )
    params = list(signature.parameters.values())
    has_self = runtime.bound_self is not None and bool(params)
    names = _Names(
        self_name=params[0].name if has_self else None,
        forward=[p.name for p in (params[1:] if has_self else params)],
        closure=set(runtime.closure_locals),
    )
    clash = [n for n in names.forward if n in _MODULE_NAMES or _LOCAL_NAME.fullmatch(n)]
    if clash:
        raise ValueError(
            f"the captured function's parameter {clash[0]!r} would shadow a name the generated "
            "module uses; to_python() cannot write this artifact as Python"
        )
    fwd_sig = _forward_signature(params[1:] if has_self else params)
    call_args = _call_expr(params[1:] if has_self else params)
    arg_exprs = [_source_expr(src, names) for src in sources]
    observed = output_of(artifact.signature)
    explicit = observed.code is not None and all(x is not None for x in arg_exprs)

    e = _Emitter()
    _emit_header(e, artifact, artifact_path, sources, observed)
    _emit_model_checks(e, artifact, names)
    e("")
    e("")
    e(f"def forward{fwd_sig}:")
    e('"""Run the compiled model: the steps of the artifact\'s ``__call__``, in order."""', 1)
    _emit_grad_mode(e, artifact, names, call_args)
    for step in runtime.checks:
        emit = _STEP_EMITTERS.get(type(step))
        if emit is not None:
            emit(e, step, names)
    _emit_extraction(e, sources, arg_exprs, explicit)
    _emit_call_and_output(e, artifact, observed, explicit, names, call_args)
    return e.text()


def _forward_signature(params: list[inspect.Parameter]) -> str:
    """``(x, mask=None, *args, **kwargs)`` without annotations; non-literal defaults by name."""
    cleaned = []
    for p in params:
        p = p.replace(annotation=inspect.Parameter.empty)
        if p.default is not inspect.Parameter.empty and _literal(p.default) is None:
            p = p.replace(default=_Raw(f"DEFAULTS[{p.name!r}]"))
        elif p.default is not inspect.Parameter.empty:
            p = p.replace(default=_Raw(_literal(p.default)))  # type: ignore[arg-type]
        cleaned.append(p)
    return str(inspect.Signature(cleaned))


class _Raw:
    """A default whose repr is the code that produces it."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __repr__(self) -> str:
        return self.code


def _call_expr(params: list[inspect.Parameter]) -> str:
    """How forward passes its own arguments on (for the no_grad re-call)."""
    P = inspect.Parameter
    parts = []
    for p in params:
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            parts.append(p.name)
        elif p.kind == P.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.kind == P.KEYWORD_ONLY:
            parts.append(f"{p.name}={p.name}")
        else:
            parts.append(f"**{p.name}")
    return ", ".join(parts)


def _model_path(source: Source) -> str:
    """``.blocks._modules['0'].eps``: attribute access where the name allows it."""
    out = []
    steps = list(source.steps)
    i = 0
    while i < len(steps):
        kind, key = steps[i]
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        name = str(nxt[1]) if nxt is not None else ""
        tables = ("_modules", "_parameters", "_buffers")
        if kind == "attr" and key in tables and nxt and nxt[0] == "item" and _is_name(name):
            out.append(f".{name}")
            i += 2
            continue
        out.append(f".{key}" if kind == "attr" else f"[{key!r}]")
        i += 1
    return "".join(out)


def _is_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _source_expr(text: str, names: _Names, tables: bool = True) -> str | None:
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
        return "MODEL" + _model_path(source)
    if source.root in names.forward:
        return source.root + source.rest
    if source.root in names.closure:
        return f"CLOSURE[{source.root!r}]" + source.rest
    return None


def _is_model_side(text: str | None, names: _Names) -> bool:
    """Whether a guard reads the model or a closure (fixed by the file), not a call's input."""
    source = Source.parse(text) if text else None
    return (
        source is not None
        and source.is_local
        and (source.root == names.self_name or source.root in names.closure)
    )


# ----------------------------------------------------------------- emitters


_PREAMBLE = """\
from torch_precompile import GuardError, Precompile
from torch_precompile.pythonify.support import (
    Identity,
    any_requires_grad,
    autocast_enabled,
    describe_identity,
    dtype_name,
    global_state,
    identity_of,
    parts_of,
    plain,
)

ARTIFACT_PATH = {path!r}
# Checks the file's checksum and that this machine meets its system guards (inductor).
ARTIFACT = Precompile.load(ARTIFACT_PATH)
PARTS = parts_of(ARTIFACT)
# What the compiled code reads as `self`: a stand-in rebuilt from the file's weights.
MODEL = PARTS.model
PARAMS = PARTS.params  # name -> parameter of MODEL (a tied weight under each of its names)
BUFFERS = PARTS.buffers  # name -> buffer of MODEL
CLOSURE = PARTS.closure  # the captured function's closure variables, by name
GLOBALS = PARTS.globals  # the globals the compiled code reads
DEFAULTS = PARTS.defaults  # defaults of the captured signature, by parameter name
# Inductor's compiled graph behind AOTAutograd's runtime wrapper:
# the flat list of graph inputs in, the flat list of graph outputs out.
COMPILED_GRAPH = PARTS.compiled_graph
"""


def _emit_header(
    e: _Emitter,
    artifact: PrecompiledArtifact,
    artifact_path: str,
    sources: list[str],
    observed: Output,
) -> None:
    sig = artifact.signature
    system = ", ".join(f"{k}={v}" for k, v in artifact.system.items() if v is not None)
    created = artifact._origin.get("created") or "unknown"
    kind = "training" if artifact.training else "inference"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    e('"""A torch_precompile artifact as readable Python.')
    e("")
    e(f"Artifact: {artifact_path}")
    e(f"Created: {created}; kind: {kind} on {artifact.device_type}")
    e(f"System: {system}")
    e(f"Captured signature: {sig.get('signature', '?')}")
    e(f"Graph inputs: {len(sources)}; output: {observed.description}")
    e(f"Generated: {now} by torch_precompile")
    e("")
    e("Importing this module loads the artifact (kernels and weights) once. ``forward(...)``")
    e("then does what the artifact's __call__ does, as plain code: check the guards,")
    e("extract the graph's inputs, call the compiled graph, rebuild the output.")
    e('"""')
    e("")
    e("import torch")
    for line in observed.imports:
        e(line)
    e("")
    e.lines.extend(_PREAMBLE.format(path=artifact_path).splitlines())


def _emit_guard(e: _Emitter, g: Guard, read: Any, indent: int, where: str) -> bool:
    """A guard's own Python form, or a comment saying where it is checked instead."""
    lines = g.python(read)
    e(f"# [{g.phase}] {g.expr}", indent)
    if lines is None:
        e(f"#   (checked by {where})", indent)
        return False
    for line in lines:
        e(line, indent)
    return True


def _emit_model_checks(e: _Emitter, artifact: PrecompiledArtifact, names: _Names) -> None:
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
        if g.kind in ("tensor", "value") and _is_model_side(g.subject, names):
            tables = g.kind == "tensor"
            read = lambda text, tables=tables: _source_expr(text, names, tables)  # noqa: E731
            emitted += _emit_guard(e, g, read, 1, "PARTS.check_structure in forward()")
    if not emitted:
        e("return None", 1)
    e("")
    e("")
    e("_check_model()")


def _emit_grad_mode(
    e: _Emitter, artifact: PrecompiledArtifact, names: _Names, call_args: str
) -> None:
    e.section("grad mode [aot_autograd]")
    for g in artifact.guards:
        if g.kind in ("autograd", "requires_grad"):
            e(f"# {g.expr}", 1)
    if artifact.training:
        e("if not torch.is_grad_enabled():", 1)
        e(f"raise GuardError({AutogradGuard.TRAINING_UNDER_NO_GRAD + ' [aot_autograd]'!r})", 2)
        return
    if artifact._runtime.grad_enabled:
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


def _f_locals(names: _Names) -> str:
    items = [f"{names.self_name!r}: MODEL"] if names.self_name else []
    items.extend(f"{n!r}: {n}" for n in names.forward)
    return "{" + ("**CLOSURE, " if names.closure else "") + ", ".join(items) + "}"


def _emit_hooks(e: _Emitter, step: CheckHooks, names: _Names) -> None:
    e.section("module hooks [dynamo]")
    if step.guard is not None:
        e(f"# {step.guard.expr}", 1)
    e(f"PARTS.check_hooks({_f_locals(names)})", 1)


def _emit_guards(e: _Emitter, step: CheckGuards, names: _Names) -> None:
    e.section("guards: global state and inputs")
    manager = "PARTS.check_structure below"
    read = lambda text: _source_expr(text, names)  # noqa: E731
    temp = 0
    for g in step.guards:
        if g.kind == "global":
            _emit_guard(e, g, read, 1, manager)
    for g in step.guards:
        if g.kind not in ("tensor", "value", "range", "shape"):
            continue
        if _is_model_side(g.subject, names):
            continue
        expr = _source_expr(g.subject, names) if g.subject else None
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
    e("# Strides, aliasing between inputs, module structure and attributes: the", 1)
    e("# artifact's guard manager (plain Python after a lean load). Failures are", 1)
    e("# explained in the words of the guards above.", 1)
    e(f"PARTS.check_structure({_f_locals(names)})", 1)
    noted = [g for g in step.guards if g.kind in ("system", "structure", "dropped")]
    if noted:
        e.section("guards checked elsewhere")
        for g in noted:
            where = {
                "system": "Precompile.load, at import",
                "structure": "PARTS.check_structure above",
                "dropped": "no one (PyTorch cannot save them)",
            }[g.kind]
            e(f"# [{g.phase}] {g.expr}  -- checked by {where}", 1)


def _emit_identities(e: _Emitter, step: CheckIdentities, names: _Names) -> None:
    entries = [g for g, _ in step.identities.local]
    if not entries:
        return
    e.section("identities of the functions the traced code called [dynamo]")
    read = lambda text: _source_expr(text, names)  # noqa: E731
    for g in entries:
        _emit_guard(e, g, read, 1, "Precompile.load (globals are checked once)")


def _emit_indices(e: _Emitter, step: CheckIndices, names: _Names) -> None:
    entries = [g for _, g in step.indices.checks]
    if not entries:
        return
    e.section("index inputs in range, IndexError as eager [inductor]")
    read = lambda text: _source_expr(text, names)  # noqa: E731
    for g in entries:
        _emit_guard(e, g, read, 1, "the kernels (CUDA asserts)")


_STEP_EMITTERS: dict[type, Any] = {
    CheckHooks: _emit_hooks,
    CheckGuards: _emit_guards,
    CheckIdentities: _emit_identities,
    CheckIndices: _emit_indices,
}


def _emit_extraction(
    e: _Emitter, sources: list[str], exprs: list[str | None], explicit: bool
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


def _emit_call_and_output(
    e: _Emitter,
    artifact: PrecompiledArtifact,
    observed: Output,
    explicit: bool,
    names: _Names,
    call_args: str,
) -> None:
    n = len(artifact.signature.get("graph_inputs", []))
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
