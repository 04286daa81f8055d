"""``PrecompiledArtifact.to_python``: the compiled runtime as a readable Python module.

In the spirit of PyTorch's "pythonify" (seed 003): what runs around the
compiled kernels, written out as plain Python instead of Dynamo bytecode:

1. guard checks, as ``if`` statements raising :class:`GuardError` with the
   guard's message (the same message the artifact's ``__call__`` gives);
2. argument extraction: each graph input in order, and the parameter,
   buffer or input it is read from;
3. the call of the compiled graph with that flat list;
4. output reconstruction: the model's return value rebuilt from the flat
   graph outputs.

The generated module loads kernels and weights from the artifact file it
names (``Precompile.load``) once, at import. :func:`runtime_parts` is the
small interface it uses; everything else in it is plain Python.

The output structure is observed, not guessed: the generator calls the
artifact once on random inputs built from the recorded input signature and
maps each leaf of the return value to the graph output (or input) it is.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import inspect
import keyword
import logging
import math
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from . import _compat
from ._guards import Guard, describe_source, diagnose
from ._signature import example_call

if TYPE_CHECKING:
    from ._artifact import PrecompiledArtifact

log = logging.getLogger("torch_precompile")

_PARAM_SOURCE = re.compile(
    r"L\['(?P<root>[^']+)'\](?P<path>(?:\._modules\['[^']*'\])*)\._(?P<kind>parameters|buffers)\['(?P<name>[^']*)'\]"
)
_ROOT = re.compile(r"L\['([^']+)'\]")
_MODULES_ITEM = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")

# Names the generated forward() reads from its module, and the locals it defines.
_MODULE_NAMES = frozenset(
    [
        "torch",
        "GuardError",
        "Precompile",
        "runtime_parts",
        "ARTIFACT",
        "ARTIFACT_PATH",
        "MODEL",
        "PARAMS",
        "BUFFERS",
        "CLOSURE",
        "GLOBALS",
        "COMPILED_GRAPH",
        "forward",
        "graph_out",
        "_RT",
        "_DEFAULTS",
        "_plain",
        "_dtype_name",
        "_autocast_enabled",
        "_any_requires_grad",
        "_expect_tensor",
    ]
)
_LOCAL_NAME = re.compile(r"(arg|value)\d+")

# What each global-state guard subject reads, as code in the generated module.
_GLOBAL_STATE_EXPR = {
    "grad mode": "torch.is_grad_enabled()",
    "default dtype": "_dtype_name(torch.get_default_dtype())",
    "deterministic algorithms": "torch.are_deterministic_algorithms_enabled()",
    "autocast": "_autocast_enabled()",
}


# ------------------------------------------------------------ runtime side


@dataclasses.dataclass
class RuntimeParts:
    """What a generated module needs from a loaded artifact, in plain names."""

    artifact: Any
    model: Any
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    closure: dict[str, Any]
    globals: dict[str, Any]
    compiled_graph: Any
    dynamo_fn: Any

    def check_guards(self, f_locals: dict[str, Any]) -> None:
        """Dynamo's guard manager on the frame's locals; a GuardError in words on failure."""
        runtime = self.artifact._runtime
        failure = runtime.hooks_failure(f_locals)
        if failure is not None:
            raise failure
        if not runtime.guard_manager.check(f_locals):
            raise diagnose(
                runtime.guards,
                f_locals,
                _compat.guard_failure_reason(runtime.guard_manager, f_locals),
            )
        runtime.check_indices(f_locals)


def runtime_parts(artifact: PrecompiledArtifact) -> RuntimeParts:
    """The model (or stand-in), its tensors by name and the compiled graph of ``artifact``."""
    runtime = artifact._runtime
    model = runtime.bound_self
    is_module = isinstance(model, torch.nn.Module)
    cf = artifact.compiled_function
    return RuntimeParts(
        artifact=artifact,
        model=model,
        # remove_duplicate=False: a tied weight is found under each of its names.
        params=dict(model.named_parameters(remove_duplicate=False)) if is_module else {},
        buffers=dict(model.named_buffers(remove_duplicate=False)) if is_module else {},
        closure=dict(runtime.closure_locals),
        globals=_compat.compiled_function_globals(cf),
        compiled_graph=_compat.compiled_graph_callable(cf),
        dynamo_fn=runtime.fn,
    )


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
    fwd_sig, defaults = _forward_signature(params[1:] if has_self else params)
    call_args = _call_expr(params[1:] if has_self else params)
    arg_exprs = [_source_expr(src, names) for src in sources]
    probe = _probe(artifact, arg_exprs, names)

    e = _Emitter()
    _emit_header(e, artifact, artifact_path, sources, probe)
    _emit_helpers(e, defaults)
    _emit_model_checks(e, artifact, names)

    e("")
    e("")
    e(f"def forward{fwd_sig}:")
    e('"""Run the compiled model; the same steps as the artifact\'s ``__call__``."""', 1)
    _emit_autograd(e, artifact, names, call_args)
    _emit_input_guards(e, artifact, names)
    _emit_guard_manager(e, names)
    explicit = probe.output is not None and probe.extraction_checked
    _emit_extraction(e, sources, arg_exprs, explicit)
    _emit_call_and_output(e, artifact, probe, explicit, names, call_args)
    return e.text()


def _forward_signature(params: list[inspect.Parameter]) -> tuple[str, dict[str, Any]]:
    """``(x, mask=None, *args, **kwargs)`` without annotations; non-literal defaults by name."""
    defaults: dict[str, Any] = {}
    cleaned = []
    for p in params:
        p = p.replace(annotation=inspect.Parameter.empty)
        if p.default is not inspect.Parameter.empty and _literal(p.default) is None:
            defaults[p.name] = p.default
            p = p.replace(default=_Raw(f"_DEFAULTS[{p.name!r}]"))
        elif p.default is not inspect.Parameter.empty:
            p = p.replace(default=_Raw(_literal(p.default)))  # type: ignore[arg-type]
        cleaned.append(p)
    return str(inspect.Signature(cleaned)), defaults


class _Raw:
    """A default whose repr is the code that produces it."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __repr__(self) -> str:
        return self.code


def _literal(value: Any) -> str | None:
    """Python code for a plain value, or None when it has no literal form."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({repr(value)!r})"
    if isinstance(value, (tuple, list)):
        items = [_literal(v) for v in value]
        if any(i is None for i in items):
            return None
        if isinstance(value, tuple):
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"  # type: ignore[arg-type]
        return "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, torch.dtype):
        return str(value)
    return None


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


def _model_path(path: str) -> str:
    """``._modules['blocks']._modules['0'].eps`` -> ``.blocks._modules['0'].eps``.

    Attribute access where the name allows it, item access elsewhere.
    """

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        return f".{name}" if name.isidentifier() and not keyword.iskeyword(name) else m.group(0)

    return _MODULES_ITEM.sub(repl, path)


def _source_expr(source: str, names: _Names, tables: bool = True) -> str | None:
    """Code reading a Dynamo source inside the generated forward, or None.

    With ``tables``, parameters and buffers read as ``PARAMS[name]`` /
    ``BUFFERS[name]``; without, through the module (a guard may say a
    parameter is None, which has no entry in the tables).
    """
    m = _PARAM_SOURCE.fullmatch(source)
    if tables and m and m.group("root") == names.self_name:
        dotted = ".".join([*re.findall(r"\['([^']*)'\]", m.group("path")), m.group("name")])
        table = "PARAMS" if m.group("kind") == "parameters" else "BUFFERS"
        return f"{table}[{dotted!r}]"
    m = _ROOT.match(source)
    if m:
        root, rest = m.group(1), source[m.end() :]
        if root == names.self_name:
            return "MODEL" + _model_path(rest)
        if root in names.forward:
            return root + rest
        if root in names.closure:
            return f"CLOSURE[{root!r}]" + rest
        return None
    if source.startswith("G['"):
        return "GLOBALS" + source[1:]
    return None


def _is_model_side(subject: str, names: _Names) -> bool:
    """Whether a guard reads the model or a closure (fixed by the file), not a call's input."""
    m = _ROOT.match(subject)
    return bool(m) and (m.group(1) == names.self_name or m.group(1) in names.closure)


# ------------------------------------------------------------------ probe


@dataclasses.dataclass
class _Probe:
    output: str | None  # code rebuilding the output from graph_out / argN, or None
    imports: list[str]
    why_not: str  # why the output cannot be rebuilt as plain code
    description: str  # the output's structure, in words
    extraction_checked: bool


def _probe(artifact: PrecompiledArtifact, exprs: list[str | None], names: _Names) -> _Probe:
    """Call the artifact once on random inputs, recording the compiled graph's flat in/out.

    The flat inputs check the argument extraction the module will use; the
    flat outputs say where each leaf of the return value comes from. The
    model's buffers and the RNG state are restored afterwards, so that
    generating a module leaves the model as it was.
    """
    runtime = artifact._runtime
    try:
        args, kwargs = example_call(
            runtime.signature,
            artifact.signature.get("parameters", {}),
            skip_first=names.self_name is not None,
        )
    except (ValueError, KeyError, TypeError) as exc:
        why = f"no example inputs can be built from the recorded signature ({exc})"
        return _Probe(None, [], why, "?", False)
    model = runtime.bound_self
    buffers = (
        [(b, b.detach().clone()) for b in model.buffers()]
        if isinstance(model, torch.nn.Module)
        else []
    )
    rng = torch.random.get_rng_state()
    grad = torch.enable_grad() if artifact.training else torch.no_grad()
    try:
        with _compat.recording_compiled_graph(artifact.compiled_function) as calls, grad:
            result = artifact(*args, **kwargs)
    except Exception as exc:
        why = f"calling the artifact on random inputs failed ({type(exc).__name__}: {exc})"
        return _Probe(None, [], why, "?", False)
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        torch.random.set_rng_state(rng)
    if len(calls) != 1:
        why = f"the compiled graph ran {len(calls)} times in one call"
        return _Probe(None, [], why, "?", False)
    flat_in, flat_out = calls[0]
    flat_out = list(flat_out) if isinstance(flat_out, (list, tuple)) else [flat_out]
    checked = _extraction_matches(artifact, args, kwargs, exprs, list(flat_in), names.self_name)
    builder = _OutputBuilder(flat_out, list(flat_in), [f"arg{i}" for i in range(len(flat_in))])
    code = builder.build(result)
    if not checked:
        builder.fail("the argument extraction did not reproduce the compiled graph's inputs")
        code = None
    return _Probe(code, builder.imports, builder.why_not, _describe_output(result), checked)


def _extraction_matches(
    artifact: PrecompiledArtifact,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exprs: list[str | None],
    flat_in: list[Any],
    self_name: str | None,
) -> bool:
    """Whether the module's extraction lines, run on this call, give the inputs the graph got."""
    runtime = artifact._runtime
    full = (runtime.bound_self, *args) if runtime.bound_self is not None else args
    try:
        bound = runtime.signature.bind(*full, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    parts = runtime_parts(artifact)
    scope = {
        "MODEL": parts.model,
        "PARAMS": parts.params,
        "BUFFERS": parts.buffers,
        "CLOSURE": parts.closure,
        "GLOBALS": parts.globals,
        **{k: v for k, v in bound.arguments.items() if k != self_name},
    }
    if len(exprs) != len(flat_in) or any(x is None for x in exprs):
        return False
    for expr, passed in zip(exprs, flat_in):
        try:
            value = eval(expr, {"__builtins__": {}}, scope)
        except Exception:
            return False
        same = value is passed or (not isinstance(value, torch.Tensor) and value == passed)
        if not same:
            return False
    return True


class _OutputBuilder:
    def __init__(self, flat_out: list[Any], flat_in: list[Any], arg_names: list[str]) -> None:
        self.flat_out = flat_out
        self.flat_in = flat_in
        self.arg_names = arg_names
        self.imports: list[str] = []
        self.why_not = ""

    def fail(self, why: str) -> None:
        if not self.why_not:
            self.why_not = why

    def build(self, value: Any) -> str | None:
        if isinstance(value, torch.Tensor):
            for i, out in enumerate(self.flat_out):
                if out is value:
                    return f"graph_out[{i}]"
            for i, inp in enumerate(self.flat_in):
                if inp is value:
                    return self.arg_names[i]
            self.fail("a returned tensor is neither a graph output nor a graph input")
            return None
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            self.fail("the output holds a symbolic size")
            return None
        if value is None or type(value) in (bool, int, float, str):
            return _literal(value)
        if type(value) in (tuple, list):
            items = [self.build(v) for v in value]
            if any(i is None for i in items):
                return None
            if type(value) is tuple:
                return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"  # type: ignore[arg-type]
            return "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
        if isinstance(value, dict):
            literal = self._dict(value)
            if literal is None:
                return None
            if type(value) is dict:
                return literal
            # A dict subclass (an HF-style ModelOutput) that a mapping constructs.
            init = type(value).__init__
            if any(
                init is getattr(base, "__init__", None)
                for base in type(value).__mro__[1:]
                if base.__module__ in ("builtins", "collections")
            ):
                cls = self._class(type(value))
                return f"{cls}({literal})" if cls else None
            self.fail(f"{type(value).__qualname__} has its own __init__")
            return None
        if isinstance(value, tuple) and hasattr(type(value), "_fields"):
            items = [self.build(v) for v in value]
            cls = self._class(type(value))
            if cls is None or any(i is None for i in items):
                return None
            return f"{cls}({', '.join(items)})"  # type: ignore[arg-type]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            if not all(f.init for f in fields):
                self.fail(f"{type(value).__qualname__} has fields outside __init__")
                return None
            parts = [(f.name, self.build(getattr(value, f.name))) for f in fields]
            cls = self._class(type(value))
            if cls is None or any(p is None for _, p in parts):
                return None
            return f"{cls}(" + ", ".join(f"{k}={v}" for k, v in parts) + ")"
        self.fail(f"the output holds a {type(value).__qualname__}")
        return None

    def _dict(self, value: dict[Any, Any]) -> str | None:
        items = []
        for k, v in value.items():
            key = _literal(k) if type(k) in (str, int, bool) else None
            item = self.build(v)
            if key is None or item is None:
                self.fail("a dict key is not a plain value") if key is None else None
                return None
            items.append(f"{key}: {item}")
        return "{" + ", ".join(items) + "}"

    def _class(self, cls: type) -> str | None:
        module, qualname = cls.__module__, cls.__qualname__
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except Exception:
            found = None
        if found is not cls or module == "__main__":
            self.fail(f"the output type {qualname} cannot be imported by name")
            return None
        line = f"import {module}"
        if line not in self.imports:
            self.imports.append(line)
        return f"{module}.{qualname}"


def _describe_output(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({str(value.dtype).replace('torch.', '')}, {tuple(value.shape)})"
    if isinstance(value, dict):
        inner = ", ".join(f"{k!r}: {_describe_output(v)}" for k, v in value.items())
        return f"{type(value).__name__}({{{inner}}})" if type(value) is not dict else f"{{{inner}}}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe_output(v) for v in value)
        return (
            f"{type(value).__name__}({inner})"
            if type(value) not in (tuple, list)
            else (f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(
            f"{f.name}={_describe_output(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({inner})"
    return (
        repr(value)
        if value is None or isinstance(value, (bool, int, float, str))
        else type(value).__name__
    )


# ----------------------------------------------------------------- emitters


_PREAMBLE = """\
from torch_precompile import GuardError, Precompile
from torch_precompile._pythonify import runtime_parts

ARTIFACT_PATH = {path!r}
# Checks the file's checksum and that this machine meets its system guards (inductor).
ARTIFACT = Precompile.load(ARTIFACT_PATH)
_RT = runtime_parts(ARTIFACT)
# What the compiled code reads as `self`: a stand-in rebuilt from the file's weights.
MODEL = _RT.model
PARAMS = _RT.params  # name -> parameter of MODEL (a tied weight under each of its names)
BUFFERS = _RT.buffers  # name -> buffer of MODEL
CLOSURE = _RT.closure  # the captured function's closure variables, by name
GLOBALS = _RT.globals  # the globals the compiled code reads
# Inductor's compiled graph behind AOTAutograd's runtime wrapper:
# the flat list of graph inputs in, the flat list of graph outputs out.
COMPILED_GRAPH = _RT.compiled_graph
"""

_HELPERS = '''

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _autocast_enabled() -> bool:
    cuda = torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    return torch.is_autocast_enabled("cpu") or cuda


def _plain(value):
    """A value as the guards recorded it: dtypes and devices by name, lists as tuples."""
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _any_requires_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_any_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_any_requires_grad(v) for v in value.values())
    return False


def _expect_tensor(value, what, dtype, shape, device, requires_grad, phase):
    """One tensor guard on the model's side (the ifs in forward() spell out the same checks)."""
    if not isinstance(value, torch.Tensor):
        raise GuardError(f"{what}: expected a tensor, got {type(value).__name__} [{phase}]")
    if _dtype_name(value.dtype) != dtype:
        got = _dtype_name(value.dtype)
        raise GuardError(f"{what}: expected dtype {dtype}, got {got} [{phase}]")
    if value.device.type != device:
        got = value.device.type
        raise GuardError(f"{what}: expected device {device}, got {got} [{phase}]")
    static = [(want, got) for want, got in zip(shape, value.shape) if isinstance(want, int)]
    if value.dim() != len(shape) or any(want != got for want, got in static):
        got = tuple(value.shape)
        raise GuardError(f"{what}: expected shape {shape}, got {got} [{phase}]")
    if value.requires_grad != requires_grad:
        got = value.requires_grad
        raise GuardError(f"{what}: requires_grad is {got}, captured with {requires_grad} [{phase}]")
'''


def _emit_header(
    e: _Emitter,
    artifact: PrecompiledArtifact,
    artifact_path: str,
    sources: list[str],
    probe: _Probe,
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
    e(f"Graph inputs: {len(sources)}; output: {probe.description}")
    e(f"Generated: {now} by torch_precompile")
    e("")
    e("Importing this module loads the artifact (kernels and weights) once. ``forward(...)``")
    e("then does what the artifact's __call__ does, as plain code: check the guards,")
    e("extract the graph's inputs, call the compiled graph, rebuild the output.")
    e('"""')
    e("")
    e("import torch")
    for line in probe.imports:
        e(line)
    e("")
    e.lines.extend(_PREAMBLE.format(path=artifact_path).splitlines())


def _emit_helpers(e: _Emitter, defaults: dict[str, Any]) -> None:
    if defaults:
        e("# Defaults of the captured signature that have no literal form.")
        e("_DEFAULTS = {")
        for k in defaults:
            e(f"{k!r}: _RT.artifact._runtime.signature.parameters[{k!r}].default,", 1)
        e("}")
    e.lines.extend(_HELPERS.splitlines())


def _emit_model_checks(e: _Emitter, artifact: PrecompiledArtifact, names: _Names) -> None:
    """Guards on the model's tensors and attributes (and closure variables), checked at import."""
    e("")
    e("")
    e("def _check_model() -> None:")
    e('"""Guards on the model\'s weights and attributes (and closure variables).', 1)
    e("", 0)
    e("They come from the artifact file, not from a call, so they are checked once, at import.", 1)
    e('"""', 1)
    count = 0
    for g in artifact.guards:
        if not g.subject or not _is_model_side(g.subject, names):
            continue
        expr = _source_expr(g.subject, names, tables=g.kind == "tensor")
        if expr is None:
            e(f"# [{g.phase}] {g.expr}  (read as {g.subject}; checked by the guard manager)", 1)
            continue
        what = describe_source(g.subject)
        if g.kind == "tensor" and isinstance(g.expected, dict):
            x = g.expected
            shape = tuple(x["shape"])
            e(
                f"_expect_tensor({expr}, {what!r}, {x['dtype']!r}, {shape!r}, {x['device']!r}, "
                f"{bool(x['requires_grad'])!r}, {g.phase!r})",
                1,
            )
            count += 1
        elif g.kind == "value":
            expected = _literal(_tupled(g.expected))
            if expected is None:
                e(f"# [{g.phase}] {g.expr}  (checked by Dynamo's guard manager)", 1)
                continue
            e(f"if {_differs(expr, expected)}:", 1)
            _raise(
                e,
                2,
                f"{what}: expected {g.expected!r}, got ",
                _Code(f"_plain({expr})!r"),
                f" [{g.phase}]",
            )
            count += 1
    if count == 0:
        e("return None", 1)
    e("")
    e("")
    e("_check_model()")


class _Code:
    """An expression inside a generated f-string (never contains quotes)."""

    def __init__(self, code: str) -> None:
        self.code = code


def _fmsg(*parts: str | _Code) -> str:
    """Code of an f-string: ``str`` parts are literal text, ``_Code`` parts ``{expressions}``."""
    body = "".join(
        "{" + p.code + "}" if isinstance(p, _Code) else p.replace("{", "{{").replace("}", "}}")
        for p in parts
    )
    return ("f" if any(isinstance(p, _Code) for p in parts) else "") + repr(body)


def _raise(e: _Emitter, indent: int, *parts: str | _Code, tail: str = "") -> None:
    """Emit ``raise GuardError(<f-string of parts>)``."""
    e(f"raise GuardError({_fmsg(*parts)}){tail}", indent)


_BAKED = "; Python values are baked into the compiled code, capture again with the new value"
_TRAINING_MSG = (
    "grad mode: captured with grad enabled (a training artifact), called under torch.no_grad(); "
    "capture again under torch.no_grad() for an inference artifact [aot_autograd]"
)
_INFERENCE_MSG = (
    "grad mode: this is an inference artifact (captured under torch.no_grad()), called with grad "
    "enabled while {culprit} requires grad; call it under torch.no_grad(), or capture again with "
    "grad enabled for a training artifact [aot_autograd]"
)


def _differs(expr: str, expected: str) -> str:
    """The condition under which a value guard fails."""
    if expected == "None":
        return f"{expr} is not None"
    return f"_plain({expr}) != {expected}"


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


def _emit_autograd(
    e: _Emitter, artifact: PrecompiledArtifact, names: _Names, call_args: str
) -> None:
    e.section("guards: autograd [aot_autograd]")
    for g in artifact.guards:
        if g.kind in ("autograd", "requires_grad"):
            e(f"# {g.expr}", 1)
    inputs = ", ".join(names.forward)
    if artifact.training:
        e("if not torch.is_grad_enabled():", 1)
        _raise(e, 2, _TRAINING_MSG)
        return
    if artifact._runtime.grad_enabled:
        # Inference captured with grad enabled (nothing required grad then).
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
        checks.append((f"_any_requires_grad([{inputs}])", "an input"))
    checks.append(("any(p.requires_grad for p in PARAMS.values())", "a parameter of the model"))
    for cond, culprit in checks:
        e(f"if {cond}:", 2)
        _raise(e, 3, _INFERENCE_MSG.format(culprit=culprit))
    e("with torch.no_grad():", 2)
    e(f"return forward({call_args})", 3)


def _emit_input_guards(e: _Emitter, artifact: PrecompiledArtifact, names: _Names) -> None:
    e.section("guards: global state [dynamo]")
    for g in artifact.guards:
        if g.kind != "global" or not g.subject:
            continue
        e(f"# {g.expr}", 1)
        read = _GLOBAL_STATE_EXPR.get(g.subject)
        expected = _literal(g.expected)
        if read is None or expected is None:
            e("#   (checked by Dynamo's guard manager below)", 1)
            continue
        cond = {"True": f"not {read}", "False": read}.get(expected, f"{read} != {expected}")
        e(f"if {cond}:", 1)
        _raise(e, 2, f"{g.subject}: expected {g.expected}, got ", _Code(read), f" [{g.phase}]")

    e.section("guards: inputs [dynamo]")
    temp = 0
    for g in artifact.guards:
        if g.kind not in ("tensor", "value") or not g.subject or _is_model_side(g.subject, names):
            continue
        expr = _source_expr(g.subject, names)
        e(f"# [{g.phase}] {g.expr}", 1)
        if expr is None:
            e("#   (read as " + g.subject + "; checked by Dynamo's guard manager below)", 1)
            continue
        what = describe_source(g.subject)
        if not expr.isidentifier():
            # A nested input (args[0], batch['x']): a missing entry is a broken guard too.
            name = f"value{temp}"
            temp += 1
            e("try:", 1)
            e(f"{name} = {expr}", 2)
            e("except (IndexError, KeyError, TypeError):", 1)
            missing = (
                f"{what}: expected a tensor, but it is missing"
                if g.kind == "tensor"
                else f"{what}: missing, expected {g.expected!r}"
            )
            _raise(e, 2, f"{missing} [{g.phase}]", tail=" from None")
            expr = name
        if g.kind == "tensor":
            _emit_tensor_ifs(e, g, expr, what)
        else:
            expected = _literal(_tupled(g.expected))
            if expected is None:
                e("#   (checked by Dynamo's guard manager below)", 1)
                continue
            e(f"if {_differs(expr, expected)}:", 1)
            got = _Code(f"_plain({expr})!r")
            _raise(e, 2, f"{what}: expected {g.expected!r}, got ", got, f"{_BAKED} [{g.phase}]")
    kinds = ("shape", "system", "structure", "hooks", "index", "dropped")
    other = [g for g in artifact.guards if g.kind in kinds]
    if other:
        e.section("guards checked elsewhere")
        for g in other:
            where = {
                "shape": "Dynamo's guard manager below",
                "system": "Precompile.load, at import",
                "structure": "Dynamo's guard manager below",
                "hooks": "_RT.check_guards below (submodules in Dynamo's guard manager)",
                "index": "_RT.check_guards below (IndexError, as eager)",
                "dropped": "no one (PyTorch cannot save them)",
            }[g.kind]
            e(f"# [{g.phase}] {g.expr}  -- checked by {where}", 1)


def _emit_tensor_ifs(e: _Emitter, g: Guard, expr: str, what: str) -> None:
    x = g.expected
    if not isinstance(x, dict):
        return
    shape = list(x["shape"])
    shape_text = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    dtype = x["dtype"]
    ph = f" [{g.phase}]"
    device = x["device"]
    e(f"if not isinstance({expr}, torch.Tensor):", 1)
    _raise(e, 2, f"{what}: expected a tensor, got ", _Code(f"type({expr}).__name__"), ph)
    e(f"if {expr}.dtype != torch.{dtype}:", 1)
    _raise(e, 2, f"{what}: expected dtype {dtype}, got ", _Code(f"_dtype_name({expr}.dtype)"), ph)
    e(f"if {expr}.device.type != {device!r}:", 1)
    _raise(e, 2, f"{what}: expected device {device}, got ", _Code(f"{expr}.device.type"), ph)
    e(f"if {expr}.dim() != {len(shape)}:", 1)
    dims = f"{what}: expected {len(shape)} dimensions {shape_text}, got "
    _raise(e, 2, dims, _Code(f"{expr}.dim()"), " ", _Code(f"tuple({expr}.shape)"), ph)
    static = [(i, s) for i, s in enumerate(shape) if isinstance(s, int)]
    if static:
        comment = ""
        if len(static) == len(shape):
            cond = f"{expr}.shape != {tuple(shape)!r}"
        else:
            cond = " or ".join(f"{expr}.shape[{i}] != {s}" for i, s in static)
            comment = (
                "  # " + ", ".join(str(s) for s in shape if not isinstance(s, int)) + " dynamic"
            )
        e(f"if {cond}:{comment}", 1)
        _raise(
            e, 2, f"{what}: expected shape {shape_text}, got ", _Code(f"tuple({expr}.shape)"), ph
        )
    want = bool(x["requires_grad"])
    e(f"if {'not ' if want else ''}{expr}.requires_grad:", 1)
    said = "does not require grad" if want else "requires grad"
    msg = (
        f"{what}: {said}, but the artifact was captured with requires_grad={want}; "
        f"capture again with the same requires_grad settings{ph}"
    )
    _raise(e, 2, msg)


def _emit_guard_manager(e: _Emitter, names: _Names) -> None:
    e.section("guards: everything, once more, in Dynamo's guard manager (C++)")
    e("# Also strides, aliasing between inputs and the module structure: the exact check", 1)
    e("# the artifact's __call__ makes. Its failures are explained like the ifs above.", 1)
    items = []
    if names.self_name:
        items.append(f"{names.self_name!r}: MODEL")
    items.extend(f"{n!r}: {n}" for n in names.forward)
    closure = "**CLOSURE, " if names.closure else ""
    e("_RT.check_guards({" + closure + ", ".join(items) + "})", 1)


def _emit_extraction(
    e: _Emitter, sources: list[str], exprs: list[str | None], explicit: bool
) -> None:
    e.section("argument extraction: the compiled graph's inputs, in order")
    if explicit:
        e("# Checked when this module was generated: on a call, these lines gave exactly", 1)
        e("# the tensors Dynamo's bytecode passed to the compiled graph.", 1)
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
    probe: _Probe,
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
        e(f"# {probe.description}", 1)
        e(f"return {probe.output}", 1)
        return
    why = probe.why_not or "an input source has no plain-code form"
    e(f"# graph_out = COMPILED_GRAPH({args})", 1)
    e.section("output reconstruction")
    e(f"# The output is rebuilt by Dynamo's bytecode, not by plain code here: {why}.", 1)
    e("# That bytecode does the argument extraction and the compiled call shown above itself.", 1)
    self_arg = "MODEL, " if names.self_name else ""
    e(f"return _RT.dynamo_fn({self_arg}{call_args})", 1)


__all__ = ["RuntimeParts", "generate", "runtime_parts", "write_module"]
