"""Guards: what an artifact assumes about its inputs and the process, in words.

``Guards`` is the readable, ordered record each stage extends. The fast check
at call time is Dynamo's own guard manager (C++); when it fails, the entries
here are evaluated one by one to say which assumption broke, what was
expected, what was found, and which stage added it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ._errors import GuardError

PHASES = ("dynamo", "aot_autograd", "inductor")

# Dynamo guard kinds that describe module plumbing rather than a user-visible
# assumption; they are still checked, but summarised in one entry.
_STRUCTURAL_KINDS = frozenset(
    {
        "NOT_PRESENT_IN_GENERIC_DICT",
        "DICT_KEYS_MATCH",
        "SEQUENCE_LENGTH",
        "TYPE_MATCH",
        "BUILTIN_MATCH",
        "DUPLICATE_INPUT",
        "NO_TENSOR_ALIASING",
        "HASATTR",
        "DICT_LENGTH",
        "LIST_LENGTH",
        "TUPLE_ITERATOR_LEN",
        "DICT_CONTAINS",
        "NOT_NONE_MATCH",
    }
)
_GLOBAL_STATE_KINDS = frozenset(
    {
        "GRAD_MODE",
        "DEFAULT_DEVICE",
        "DETERMINISTIC_ALGORITHMS",
        "TORCH_FUNCTION_STATE",
        "AUTOGRAD_SAVED_TENSORS_HOOKS",
        "FSDP_TRAINING_STATE",
    }
)


@dataclasses.dataclass(frozen=True)
class Guard:
    """One assumption of an artifact.

    ``phase`` is the stage that added it, ``kind`` its family (``tensor``,
    ``value``, ``global``, ``shape``, ``system``, ``autograd``, ``hooks``,
    ``structure``), ``expr`` a readable statement. ``subject`` and
    ``expected`` let the runtime re-check it to explain a failure.
    """

    phase: str
    kind: str
    expr: str
    subject: str | None = None
    expected: Any = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        return f"[{self.phase}] {self.expr}"

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "kind": self.kind,
            "expr": self.expr,
            "subject": self.subject,
            "expected": _jsonable(self.expected),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Guard:
        return cls(
            data["phase"], data["kind"], data["expr"], data.get("subject"), data.get("expected")
        )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


class Guards(Sequence[Guard]):
    """An immutable, ordered collection of :class:`Guard` entries."""

    __slots__ = ("_capture_id", "_entries")

    def __init__(self, entries: Sequence[Guard] = (), *, capture_id: str | None = None):
        object.__setattr__(self, "_entries", tuple(entries))
        object.__setattr__(self, "_capture_id", capture_id)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: Any) -> Any:
        return self._entries[index]

    def __iter__(self) -> Iterator[Guard]:
        return iter(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Guards) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(self._entries)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Guards is immutable; use extend() to get a new one")

    @property
    def capture_id(self) -> str | None:
        """Identifies the Dynamo capture these guards were derived from."""
        return self._capture_id

    def by_phase(self, phase: str) -> Guards:
        """The entries one stage added (``dynamo``, ``aot_autograd`` or ``inductor``)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        return Guards([g for g in self._entries if g.phase == phase], capture_id=self._capture_id)

    def extend(self, entries: Sequence[Guard]) -> Guards:
        """A new collection with these entries appended."""
        return Guards(self._entries + tuple(entries), capture_id=self._capture_id)

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self._entries]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]], capture_id: str | None = None) -> Guards:
        return cls([Guard.from_json(d) for d in data], capture_id=capture_id)

    def __str__(self) -> str:
        lines = []
        for phase in PHASES:
            entries = [g for g in self._entries if g.phase == phase]
            if entries:
                lines.append(f"{phase} ({len(entries)}):")
                lines.extend(f"  {g.expr}" for g in entries)
        return "\n".join(lines) if lines else "(no guards)"

    def __repr__(self) -> str:
        counts = ", ".join(f"{p}={sum(g.phase == p for g in self._entries)}" for p in PHASES)
        return f"Guards({len(self)} entries: {counts})"


# ------------------------------------------------------------ readable names

_ITEM = re.compile(r"\[(?:'([^']*)'|(-?\d+))\]")


def describe_source(source: str) -> str:
    """``L['self']._modules['l1']._parameters['weight']`` -> ``parameter 'l1.weight'``."""
    m = re.fullmatch(r"L\['([^']+)'\](.*)", source)
    if not m:
        return source
    root, rest = m.group(1), m.group(2)
    if root == "self":
        path = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", rest)
        kind = "attribute"
        if "._parameters[" in rest:
            kind = "parameter"
        elif "._buffers[" in rest:
            kind = "buffer"
        elif rest.endswith("]") or not rest:
            kind = "module"
        path = path.lstrip(".")
        return f"{kind} '{path}'" if path else "the model"
    suffix = _ITEM.sub(
        lambda mm: f"[{mm.group(1)!r}]" if mm.group(1) is not None else f"[{mm.group(2)}]", rest
    )
    return f"input '{root}{suffix}'"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor_expectation(
    value: torch.Tensor, dynamic_dims: dict[int, str] | None = None
) -> dict[str, Any]:
    dynamic_dims = dynamic_dims or {}
    shape = [
        dynamic_dims.get(i, int(s)) if not dynamic_dims.get(i) else dynamic_dims[i]
        for i, s in enumerate(value.shape)
    ]
    return {
        "dtype": _dtype_name(value.dtype),
        "shape": shape,
        "device": value.device.type,
        "requires_grad": bool(value.requires_grad),
    }


def _shape_str(shape: Sequence[Any]) -> str:
    inner = ", ".join(str(s) for s in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def _tensor_expr(subject: str, exp: dict[str, Any]) -> str:
    grad = ", requires_grad" if exp["requires_grad"] else ""
    shape = _shape_str(exp["shape"])
    return f"{describe_source(subject)}: {exp['dtype']} {shape} on {exp['device']}{grad}"


# ---------------------------------------------------- guards from a capture


def dynamo_guards(
    dynamo_guard_list: Sequence[Any],
    local_scope: dict[str, Any],
    shape_symbols: dict[str, str],
    shape_exprs: Sequence[str],
    global_state: dict[str, Any],
    root_is_module: bool = False,
) -> list[Guard]:
    """Translate Dynamo's guards into readable entries.

    ``root_is_module``: the traced function is a module's ``forward``, so the
    artifact stands for calling that module, whose own hooks then count.
    """
    entries: list[Guard] = []
    structural: dict[str, int] = {}
    hooked: list[str] = []  # modules whose hook dicts Dynamo read as empty
    seen: set[tuple[str, str]] = set()
    scope = {"L": local_scope}
    dyn_dims = _dynamic_dims(shape_symbols)
    for g in dynamo_guard_list:
        kind = g.create_fn_name()
        name = g.name
        key = ("value" if kind in ("CONSTANT_MATCH", "EQUALS_MATCH") else kind, name)
        if key in seen:
            continue
        seen.add(key)
        if kind == "TENSOR_MATCH" and name.startswith("L["):
            value = _eval_source(name, scope)
            if isinstance(value, torch.Tensor):
                exp = tensor_expectation(value, dyn_dims.get(name))
                entries.append(Guard("dynamo", "tensor", _tensor_expr(name, exp), name, exp))
        elif kind in ("CONSTANT_MATCH", "EQUALS_MATCH") and name.startswith("L["):
            value = _eval_source(name, scope)
            if isinstance(
                value, (bool, int, float, str, type(None), tuple, torch.dtype, torch.device)
            ):
                if isinstance(value, (torch.dtype, torch.device)):
                    value = str(value)
                entries.append(
                    Guard("dynamo", "value", f"{describe_source(name)} == {value!r}", name, value)
                )
        elif kind in _GLOBAL_STATE_KINDS or kind == "GLOBAL_STATE":
            structural_name = "global:" + kind
            structural[structural_name] = 1
        elif kind == "SHAPE_ENV":
            continue
        elif kind == "EMPTY_NN_MODULE_HOOKS_DICT":
            module = name.rsplit(".", 1)[0]
            if module not in hooked:
                hooked.append(module)
        else:
            structural[kind] = structural.get(kind, 0) + 1
    for key, value in global_state.items():
        entries.append(Guard("dynamo", "global", f"{key} == {value}", key, value))
    for expr in shape_exprs:
        entries.append(
            Guard("dynamo", "shape", _readable_shape_expr(expr, shape_symbols), None, expr)
        )
    if hooked or root_is_module:
        entries.append(hooks_guard(hooked, root_is_module))
    plumbing = {k: v for k, v in structural.items() if not k.startswith("global:")}
    if plumbing:
        total = sum(plumbing.values())
        detail = ", ".join(f"{v} {k}" for k, v in sorted(plumbing.items(), key=lambda kv: -kv[1]))
        entries.append(
            Guard(
                "dynamo",
                "structure",
                f"{total} checks of module structure and Python objects ({detail})",
            )
        )
    return entries


# ------------------------------------------------------------ module hooks

ROOT_SOURCE = "L['self']"


def hooks_guard(modules: Sequence[str], root_is_module: bool) -> Guard:
    """The ``hooks`` entry: which modules' hook dicts each call checks are empty.

    ``modules`` are the sources of the submodules whose ``__call__`` Dynamo
    inlined (it read their hook dicts as empty); with ``root_is_module`` the
    model itself is checked too. Global module hooks are checked whenever a
    module is involved.
    """
    n = len(modules)
    parts = []
    if root_is_module:
        parts.append("the model")
    if n:
        parts.append(f"the {n} submodule{'s' if n != 1 else ''} the compiled code calls")
    expr = (
        f"no module hooks: {' and '.join(parts)} have no forward, forward pre-, backward or "
        "backward pre-hook, and no global module hook is registered (checked at each call: "
        "the compiled code would not run them)"
    )
    sources = ([ROOT_SOURCE] if root_is_module else []) + list(modules)
    return Guard("dynamo", "hooks", expr, ROOT_SOURCE if root_is_module else None, sources)


def hooked_modules(guards: Sequence[Guard]) -> list[str] | None:
    """The module sources a ``hooks`` entry covers (None: the guards have none)."""
    for g in guards:
        if g.kind == "hooks" and isinstance(g.expected, list):
            return [str(s) for s in g.expected]
    return None


def _hook_name(hook: Any) -> str:
    fn = getattr(hook, "__func__", hook)
    qualname = getattr(fn, "__qualname__", None) or type(hook).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def explain_hooks(module_sources: Sequence[str], f_locals: dict[str, Any]) -> GuardError | None:
    """The GuardError for the first registered hook the compiled code would not run, or None."""
    from ._compat import registered_global_hooks, registered_hooks

    scope = {"L": f_locals}
    for src in module_sources:
        module = _eval_source(src, scope)
        if module is _MISSING:
            continue
        hooks = registered_hooks(module)
        if not hooks:
            continue
        words, hook = hooks[0]
        if src == ROOT_SOURCE:
            return GuardError(
                f"the model has a {words} ({_hook_name(hook)}): the artifact runs the compiled "
                "forward without the model's hooks, so it would not run it; remove the hook "
                "(handle.remove()) and do its work around the call, or call the model eagerly "
                "while it is registered [dynamo]"
            )
        what = describe_source(src)
        return GuardError(
            f"{what} has a {words} ({_hook_name(hook)}): the compiled code calls {what} "
            "without hooks (none was registered at capture), so it would not run it; remove the "
            "hook (handle.remove()) before calling the artifact, or register it before capturing "
            "and capture again [dynamo]"
        )
    hooks = registered_global_hooks()
    if hooks:
        words, hook = hooks[0]
        return GuardError(
            f"a {words} is registered ({_hook_name(hook)}): it would run on every module call, "
            "and the compiled code runs no module hooks; remove it (handle.remove()) while the "
            "artifact serves calls, or call the model eagerly [dynamo]"
        )
    return None


def _dynamic_dims(shape_symbols: dict[str, str]) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = {}
    for sym, src in shape_symbols.items():
        m = re.fullmatch(r"(.*)\.size\(\)\[(\d+)\]", src)
        if m:
            out.setdefault(m.group(1), {})[int(m.group(2))] = sym
    return out


def _readable_shape_expr(expr: str, shape_symbols: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        src = shape_symbols.get(m.group(0))
        if src is None:
            return m.group(0)
        mm = re.fullmatch(r"(.*)\.size\(\)\[(\d+)\]", src)
        if mm:
            return f"{describe_source(mm.group(1))}.shape[{mm.group(2)}]"
        return src

    return re.sub(r"\bs\d+\b", repl, expr)


def _eval_source(source: str, scope: dict[str, Any]) -> Any:
    try:
        return eval(source, {"__builtins__": {"type": type, "dict": dict, "len": len}}, scope)
    except Exception:
        return _MISSING


_MISSING = object()


# --------------------------------------------------------------- diagnosis


def diagnose(guards: Guards, f_locals: dict[str, Any], fallback: str) -> GuardError:
    """Explain which guard the given call breaks, as a GuardError."""
    scope = {"L": f_locals}
    grad_enabled = torch.is_grad_enabled()
    # Grad mode first, then the recorded ranges (they say what sizes are served),
    # then everything else in stage order.
    order = sorted(guards, key=_diagnosis_rank)
    values: dict[str, int] | None = None
    for g in order:
        if g.kind == "shape" and isinstance(g.expected, dict):
            problem = _check_range(g, scope)
        elif g.kind == "shape":
            if values is None:
                values = _symbol_values(guards, scope)
            problem = _check_shape_expr(g, values)
        else:
            problem = _check_one(g, scope, grad_enabled)
        if problem:
            return GuardError(f"{problem} [{g.phase}]")
    hint = _inference_mode_hint(fallback, f_locals)
    return GuardError(f"a guard failed: {fallback}{hint} [dynamo]")


def unmet_by(guards: Sequence[Guard], self_value: Any) -> list[str]:
    """The tensor and value guards on ``self`` that ``self_value`` (a stand-in) breaks."""
    scope = {"L": {"self": self_value}}
    problems = []
    for g in guards:
        if g.kind in ("tensor", "value") and (g.subject or "").startswith("L['self']"):
            problem = _check_one(g, scope, torch.is_grad_enabled())
            if problem:
                problems.append(problem)
    return problems


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)


def _inference_mode_hint(reason: str, f_locals: dict[str, Any]) -> str:
    """What to do when a dispatch-key mismatch comes from ``torch.inference_mode()``."""
    m = re.search(r"expected (DispatchKeySet\([^)]*\)), actual (DispatchKeySet\([^)]*\))", reason)
    if m is None:
        return ""
    expected, actual = m.groups()
    if "ADInplaceOrView" in expected and "ADInplaceOrView" not in actual:
        if any(t.is_inference() for t in _tensors_in(f_locals)):
            return (
                "; an input is an inference tensor (made under torch.inference_mode()) and the "
                "capture saw normal tensors: make the inputs outside inference_mode, or capture "
                "under torch.inference_mode()"
            )
    elif "Autograd" in actual and "Autograd" not in expected:
        return (
            "; the capture ran under torch.inference_mode() with inference tensors: call it "
            "under torch.inference_mode() with inputs made there, or capture without it"
        )
    return ""


def _diagnosis_rank(g: Guard) -> int:
    if g.kind in ("autograd", "hooks"):
        return 0
    if g.kind == "shape" and isinstance(g.expected, dict):
        return 1
    return 2


def _check_one(g: Guard, scope: dict[str, Any], grad_enabled: bool) -> str | None:
    if g.kind == "autograd":
        return _check_autograd(g, grad_enabled)
    if g.kind == "hooks" and isinstance(g.expected, list):
        error = explain_hooks(g.expected, scope["L"])
        return str(error).rsplit(" [", 1)[0] if error is not None else None
    if g.kind == "tensor" and g.subject:
        value = _eval_source(g.subject, scope)
        what = describe_source(g.subject)
        if value is _MISSING:
            return f"{what}: expected a tensor, but it is missing"
        if not isinstance(value, torch.Tensor):
            return f"{what}: expected a tensor, got {type(value).__name__}"
        exp = g.expected
        if _dtype_name(value.dtype) != exp["dtype"]:
            return f"{what}: expected dtype {exp['dtype']}, got {_dtype_name(value.dtype)}"
        if value.device.type != exp["device"]:
            return f"{what}: expected device {exp['device']}, got {value.device.type}"
        shape = exp["shape"]
        if len(shape) != value.dim():
            return (
                f"{what}: expected {len(shape)} dimensions {_shape_str(shape)}, "
                f"got {value.dim()} {_shape_str(tuple(value.shape))}"
            )
        for want, got in zip(shape, value.shape):
            if isinstance(want, int) and want != got:
                got_shape = _shape_str(tuple(value.shape))
                return f"{what}: expected shape {_shape_str(shape)}, got {got_shape}"
        if bool(value.requires_grad) != exp["requires_grad"]:
            said = "requires grad" if value.requires_grad else "does not require grad"
            return (
                f"{what}: {said}, but the artifact was captured with "
                f"requires_grad={exp['requires_grad']}; "
                "capture again with the same requires_grad settings"
            )
        return None
    if g.kind == "value" and g.subject:
        value = _eval_source(g.subject, scope)
        if value is _MISSING:
            return f"{describe_source(g.subject)}: missing, expected {g.expected!r}"
        if isinstance(value, (torch.dtype, torch.device)):
            value = str(value)
        expected = tuple(g.expected) if isinstance(g.expected, list) else g.expected
        if isinstance(value, list) and isinstance(expected, tuple):
            value = tuple(value)
        if value != expected:
            return (
                f"{describe_source(g.subject)}: expected {g.expected!r}, got {value!r}; "
                "Python values are baked into the compiled code, capture again with the new value"
            )
        return None
    if g.kind == "identity" and g.subject:
        scope_module = (g.expected or {}).get("scope")
        return check_identity(g, resolve_source(g.subject, scope["L"], {}, scope_module))
    if g.kind == "global" and g.subject:
        from ._compat import global_state_snapshot

        now = global_state_snapshot().get(g.subject)
        if now is not None and now != g.expected:
            hint = _GLOBAL_HINTS.get(g.subject, "")
            return f"{g.subject}: expected {g.expected}, got {now}{hint}"
        return None
    return None


# Dynamo guards the process-wide state; say how to meet it without a new capture.
_GLOBAL_HINTS = {
    "num threads": (
        "; Dynamo guards torch.get_num_threads(): call torch.set_num_threads() with the "
        "captured value, or capture where the thread count is the one you deploy with"
    ),
    "default dtype": "; call torch.set_default_dtype() with the captured dtype",
}


def _check_autograd(g: Guard, grad_enabled: bool) -> str | None:
    training = bool(g.expected)
    if training and not grad_enabled:
        return (
            "grad mode: captured with grad enabled (a training artifact), called under "
            "torch.no_grad(); capture again under torch.no_grad() for an inference artifact"
        )
    # An inference artifact runs in the grad mode it was captured in (the runtime
    # switches to it, or refuses first when something requires grad), so the
    # caller's grad mode is not what broke it: it may be captured with grad enabled.
    return None


# ------------------------------------------- identity guards, made savable
#
# Dynamo guards functions, classes and modules by ``id()``, which means
# nothing in another process, so PyTorch refuses to save those guards. We
# replace each with a check that can be saved: a function by its qualified
# name, file and a hash of its bytecode; a class or builtin by module and
# qualified name; a module by name.

_ROOT = re.compile(r"([LG])\['([^']+)'\]")
_STEP = re.compile(r"\.(\w+)|\['([^']*)'\]|\[(-?\d+)\]")


def parse_source(source: str) -> tuple[str, str, list[tuple[str, Any]]] | None:
    """``L['self'].config.x`` -> ("L", "self", [("attr", "config"), ("attr", "x")])."""
    m = _ROOT.match(source)
    if not m:
        return None
    steps: list[tuple[str, Any]] = []
    pos = m.end()
    while pos < len(source):
        mm = _STEP.match(source, pos)
        if not mm:
            return None
        if mm.group(1) is not None:
            steps.append(("attr", mm.group(1)))
        elif mm.group(2) is not None:
            steps.append(("item", mm.group(2)))
        else:
            steps.append(("item", int(mm.group(3))))
        pos = mm.end()
    return m.group(1), m.group(2), steps


def code_hash(code: types.CodeType) -> str:
    """SHA-256 of a code object's bytecode, names and constants (nested code included)."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()


def identity_of(value: Any) -> dict[str, Any] | None:
    """What identifies ``value`` across processes, or None if nothing does."""
    fn = value
    if isinstance(fn, functools.partial):
        return None
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        return {
            "what": "function",
            "module": getattr(fn, "__module__", None),
            "qualname": fn.__qualname__,
            "file": code.co_filename,
            "code_hash": code_hash(code),
        }
    if isinstance(fn, types.CodeType):
        return {
            "what": "code",
            "qualname": fn.co_qualname,
            "file": fn.co_filename,
            "code_hash": code_hash(fn),
        }
    if isinstance(fn, types.ModuleType):
        return {"what": "module", "name": fn.__name__}
    if isinstance(fn, (type, types.BuiltinFunctionType)):
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if module is None or qualname is None:
            return None
        what = "class" if isinstance(fn, type) else "builtin"
        return {"what": what, "module": module, "qualname": qualname}
    return None


def _identity_text(ident: dict[str, Any]) -> str:
    what = ident["what"]
    if what == "module":
        return f"module {ident['name']}"
    if what in ("function", "code"):
        where = f"{ident['module']}." if ident.get("module") else ""
        digest = ident["code_hash"][:12]
        return f"{what} {where}{ident['qualname']} ({ident['file']}, bytecode sha256 {digest})"
    return f"{what} {ident['module']}.{ident['qualname']}"


def identity_guard(
    source: str, value: Any, scope_module: str | None, closure_names: Sequence[str] = ()
) -> Guard | None:
    """A savable replacement for an ID_MATCH-style Dynamo guard, or None."""
    parsed = parse_source(source)
    if parsed is None:
        return None
    ident = identity_of(value)
    if ident is None:
        return None
    expected = dict(ident, scope=scope_module)
    where = _where(source)
    if parsed[0] == "L" and parsed[1] in closure_names:
        where = where.replace("input '", "closure variable '", 1)
    return Guard("dynamo", "identity", f"{where} is {_identity_text(ident)}", source, expected)


def _where(source: str) -> str:
    return describe_source(source) if source.startswith("L[") else f"global {_global_name(source)}"


def _global_name(source: str) -> str:
    parsed = parse_source(source)
    if parsed is None:
        return source
    _, root, steps = parsed
    if root.startswith("__import_"):
        root = root[len("__import_") :].replace("_dot_", ".")
    elif root.startswith("__builtins_dict__"):
        root = "builtins"
        if steps and steps[0][0] == "item":
            root, steps = str(steps[0][1]), steps[1:]
    return root + "".join(f".{s}" if kind == "attr" else f"[{s!r}]" for kind, s in steps)


class _Unresolved:
    """The source names something absent from this process (not read by the artifact)."""


_UNRESOLVED = _Unresolved()


def resolve_source(
    source: str, f_locals: dict[str, Any], f_globals: dict[str, Any], scope_module: str | None
) -> Any:
    """Evaluate a Dynamo source path without eval(); globals resolve in this process."""
    parsed = parse_source(source)
    if parsed is None:
        return _UNRESOLVED
    scope, root, steps = parsed
    if scope == "L":
        if root not in f_locals:
            return _MISSING
        obj = f_locals[root]
    elif root in f_globals:
        obj = f_globals[root]
    elif root.startswith("__import_"):
        import importlib

        try:
            obj = importlib.import_module(root[len("__import_") :].replace("_dot_", "."))
        except ImportError:
            return _UNRESOLVED
    elif root.startswith("__builtins_dict__"):
        import builtins

        obj = builtins.__dict__
    else:
        # A global of the traced module: check it only where that module is
        # loaded; elsewhere the artifact carries its own copy of what it used.
        module = sys.modules.get(scope_module or "")
        if module is None or not hasattr(module, root):
            return _UNRESOLVED
        obj = getattr(module, root)
    for kind, key in steps:
        try:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
        except Exception:
            return _MISSING
    return obj


def check_identity(g: Guard, value: Any) -> str | None:
    """Why ``value`` is not what the identity guard ``g`` expects, or None."""
    if value is _UNRESOLVED:
        return None
    where = g.expr.split(" is ", 1)[0]
    expected = {k: v for k, v in (g.expected or {}).items() if k != "scope"}
    if value is _MISSING:
        return f"{where}: missing, expected {_identity_text(expected)}"
    found = identity_of(value)
    if found != expected:
        got = _identity_text(found) if found else f"a {type(value).__name__}"
        return (
            f"{where}: expected {_identity_text(expected)}, got {got}; the code Dynamo traced has "
            "changed, capture again"
        )
    return None


class IdentityChecks:
    """The identity guards of an artifact, checked cheaply.

    Globals are checked once (when the artifact is built or loaded); locals
    (closure variables, arguments) on each call, by full comparison only when
    the object differs from the last one that passed.
    """

    def __init__(self, guards: Sequence[Guard], f_globals: dict[str, Any]) -> None:
        entries = [g for g in guards if g.kind == "identity" and g.subject]
        self.local = [g for g in entries if g.subject.startswith("L[")]  # type: ignore[union-attr]
        self.global_failure: tuple[Guard, str] | None = None
        for g in entries:
            if g.subject.startswith("G["):  # type: ignore[union-attr]
                scope = (g.expected or {}).get("scope")
                value = resolve_source(g.subject, {}, f_globals, scope)  # type: ignore[arg-type]
                problem = check_identity(g, value)
                if problem:
                    self.global_failure = (g, problem)
                    break
        self._passed: dict[int, Any] = {}

    def check(self, f_locals: dict[str, Any]) -> GuardError | None:
        if self.global_failure is not None:
            g, problem = self.global_failure
            return GuardError(f"{problem} [{g.phase}]")
        for i, g in enumerate(self.local):
            value = resolve_source(g.subject, f_locals, {}, None)  # type: ignore[arg-type]
            if value is not _MISSING and self._passed.get(i) is value:
                continue
            problem = check_identity(g, value)
            if problem:
                return GuardError(f"{problem} [{g.phase}]")
            self._passed[i] = value
        return None


# ------------------------------------------------ dynamic-shape ranges


def range_guards(
    ranges: dict[str, tuple[int, int | None]], sources: dict[str, str], size_oblivious: bool
) -> list[Guard]:
    """One ``shape`` entry per dynamic input dimension: the sizes the artifact serves."""
    out = []
    for sym, src in sorted(sources.items(), key=lambda kv: kv[1]):
        m = re.fullmatch(r"(.*)\.size\(\)\[(\d+)\]", src)
        if not m or sym not in ranges:
            continue
        lo, hi = ranges[sym]
        tensor, dim = m.group(1), int(m.group(2))
        note = ""
        if lo >= 2 and not size_oblivious:
            note = (
                " (0/1 are specialised: capture with size_oblivious=True, or with "
                "torch._dynamo.mark_dynamic(t, dim, min=1), to serve them)"
            )
        elif lo >= 2:
            note = (
                f" (sizes below {lo} were excluded while capturing or compiling: "
                "see the shape guards)"
            )
        hi_text = "inf" if hi is None else str(hi)
        expr = f"{describe_source(tensor)}: dimension {dim} ({sym}) in [{lo}, {hi_text}]{note}"
        expected = {"symbol": sym, "dim": dim, "min": lo, "max": hi, "note": note}
        out.append(Guard("dynamo", "shape", expr, tensor, expected))
    return out


def _symbol_values(guards: Sequence[Guard], scope: dict[str, Any]) -> dict[str, int]:
    values = {}
    for g in guards:
        if g.kind == "shape" and isinstance(g.expected, dict) and g.subject:
            t = _eval_source(g.subject, scope)
            if isinstance(t, torch.Tensor) and g.expected["dim"] < t.dim():
                values[g.expected["symbol"]] = int(t.shape[g.expected["dim"]])
    return values


def _check_range(g: Guard, scope: dict[str, Any]) -> str | None:
    t = _eval_source(g.subject or "", scope)
    exp = g.expected
    if not isinstance(t, torch.Tensor) or exp["dim"] >= t.dim():
        return None
    size = int(t.shape[exp["dim"]])
    lo, hi = exp["min"], exp["max"]
    if size < lo or (hi is not None and size > hi):
        hi_text = "inf" if hi is None else str(hi)
        return (
            f"{describe_source(g.subject or '')}: dimension {exp['dim']} "
            f"must be in [{lo}, {hi_text}] "
            f"(the range recorded at capture), got {size}{exp.get('note', '')}; shape "
            f"{_shape_str(tuple(t.shape))}"
        )
    return None


def _check_shape_expr(g: Guard, values: dict[str, int]) -> str | None:
    """Evaluate a symbolic-shape guard (``Ne(s27, 128)``) with the call's sizes."""
    if not isinstance(g.expected, str) or not values:
        return None
    try:
        import sympy

        syms = set(re.findall(r"\b[a-z]+\d+\b", g.expected))
        if not syms or not syms <= set(values):
            return None
        expr = sympy.sympify(g.expected, locals={s: sympy.Symbol(s, integer=True) for s in syms})
        ok = expr.subs({sympy.Symbol(s, integer=True): v for s, v in values.items() if s in syms})
        if ok in (sympy.true, True):
            return None
        if ok in (sympy.false, False):
            sizes = ", ".join(f"{s}={values[s]}" for s in sorted(syms))
            return f"shape guard {g.expr} does not hold for this call ({sizes})"
    except Exception:
        return None
    return None
