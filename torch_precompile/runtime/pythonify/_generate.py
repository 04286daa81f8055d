"""``PrecompiledArtifact.to_python``: the compiled runtime as a readable Python module.

In the spirit of PyTorch's "pythonify": the artifact's call path
(:mod:`torch_precompile.runtime.call`), printed step by step as plain Python:

1. grad mode, then each guard as ``if`` statements raising the guard's own
   message (the typed guards of :mod:`torch_precompile.guards` print them);
2. argument extraction: each graph input in order, and the parameter,
   buffer or input it is read from;
3. the call of the compiled graph with that flat list;
4. output reconstruction: the model's return value rebuilt from the flat
   graph outputs.

The generated module imports only :mod:`torch_precompile.runtime.pythonify.support`
and loads kernels and weights from the artifact file it names, once.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import tempfile
from typing import TYPE_CHECKING

from ...guards._python import literal as _literal
from ..call import CheckGuards
from ._names import LOCAL_NAME, MODULE_NAMES, Emitter, Names, source_expr
from ._output import Output, output_of
from ._steps import (
    STEP_EMITTERS,
    emit_call_and_output,
    emit_extraction,
    emit_grad_mode,
    emit_guard_tree,
    emit_model_checks,
)

if TYPE_CHECKING:
    from ..artifact import PrecompiledArtifact

log = logging.getLogger("torch_precompile")

# Names the generated forward() reads from its module, and the locals it defines.


def write_module(
    artifact: PrecompiledArtifact,
    path: str | os.PathLike[str],
    artifact_path: str | os.PathLike[str] | None,
) -> str:
    """Generate the module for ``artifact`` and write it to ``path`` atomically."""
    target = artifact_path if artifact_path is not None else artifact.origin.get("path")
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
    runtime = artifact.runtime
    signature: inspect.Signature = runtime.signature
    sources = artifact.signature.graph_inputs
    if not sources:
        raise ValueError(
            "this artifact does not record where its graph inputs come from (written by an older "
            "torch_precompile or by torch's save_compiled_function); compile and save it again"
        )
    params = list(signature.parameters.values())
    has_self = runtime.bound_self is not None and bool(params)
    names = Names(
        self_name=params[0].name if has_self else None,
        forward=[p.name for p in (params[1:] if has_self else params)],
        closure=set(runtime.closure_locals),
    )
    clash = [n for n in names.forward if n in MODULE_NAMES or LOCAL_NAME.fullmatch(n)]
    if clash:
        raise ValueError(
            f"the captured function's parameter {clash[0]!r} would shadow a name the generated "
            "module uses; to_python() cannot write this artifact as Python"
        )
    fwd_sig = _forward_signature(params[1:] if has_self else params)
    call_args = _call_expr(params[1:] if has_self else params)
    arg_exprs = [source_expr(src, names) for src in sources]
    observed = output_of(artifact.signature)
    explicit = observed.code is not None and all(x is not None for x in arg_exprs)

    e = Emitter()
    _emit_header(e, artifact, artifact_path, sources, observed)
    emit_model_checks(e, artifact, names)
    emit_guard_tree(e, next(s for s in runtime.checks if isinstance(s, CheckGuards)))
    e("")
    e("")
    e(f"def forward{fwd_sig}:")
    e('"""Run the compiled model: the steps of the artifact\'s ``__call__``, in order."""', 1)
    emit_grad_mode(e, artifact, names, call_args)
    for step in runtime.checks:
        emit = STEP_EMITTERS.get(type(step))
        if emit is not None:
            emit(e, step, names)
    emit_extraction(e, sources, arg_exprs, explicit)
    emit_call_and_output(e, artifact, observed, explicit, names, call_args)
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


# ----------------------------------------------------------------- emitters


_PREAMBLE = """\
from torch_precompile import GuardError, Precompile
from torch_precompile.runtime.pythonify.support import (
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
    e: Emitter,
    artifact: PrecompiledArtifact,
    artifact_path: str,
    sources: list[str],
    observed: Output,
) -> None:
    sig = artifact.signature
    system = ", ".join(f"{k}={v}" for k, v in artifact.system.items() if v is not None)
    created = artifact.origin.get("created") or "unknown"
    kind = "training" if artifact.training else "inference"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    e('"""A torch_precompile artifact as readable Python.')
    e("")
    e(f"Artifact: {artifact_path}")
    e(f"Created: {created}; kind: {kind} on {artifact.device_type}")
    e(f"System: {system}")
    e(f"Captured signature: {sig.text or '?'}")
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
