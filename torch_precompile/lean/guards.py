"""Lean guards, at load: the saved spec as a plain-Python check that needs no Dynamo."""

from __future__ import annotations

import ast
import collections
import dataclasses
import itertools
import logging
import pickle
from typing import Any

import torch

from .guard_types import (
    LEAN_TYPES,
    MethodRead,
    global_state_at_any_threads,
    named_class,
    shape_expr_ok,
)
from .pickling import dumps
from .pycode import code_for
from .subclasses import DTensorSpecCheck, MeshCheck

# (python type, dtype, requires_grad, size, stride, dispatch keys, device): a size
# or stride of None is dynamic; a device of None is the CPU, an int a CUDA index.
_TensorCheck = tuple[
    type, torch.dtype, bool, tuple[int | None, ...], tuple[int | None, ...], int, int | None
]


GUARDS_FILENAME = "<torch_precompile lean guards>"


def _same_dims(actual: Any, expected: tuple[int | None, ...]) -> bool:
    return len(actual) == len(expected) and all(
        e is None or a == e for a, e in zip(actual, expected)
    )


@dataclasses.dataclass(frozen=True)
class Emitted:
    """A spec turned into Python: the check's source, the constants it reads, and what
    it leaves to be checked together (tensors, aliasing). The same for one spec on
    one version of this package and of torch, so the save keeps it (:func:`prepared`)."""

    source: str
    consts: dict[str, Any]
    tensor_checks: list[_TensorCheck]
    alias_groups: list[list[str]]  # distinct, non-overlapping tensors
    same_groups: list[list[str]]  # one object (OBJECT_ALIASING)


# The version of what ``_Emitter`` writes: bumped whenever the source it writes, the
# names it expects in the namespace or the constants change, so that a file's saved
# emission (``prepared``) is used only by a load that would have written the same.
EMITTED_VERSION = 1


class LeanGuards:
    """The lean check: plain Python over ``torch`` and ``torch._C``, no ``torch._dynamo``.

    The saved tree is turned once into one straight-line Python function (as
    Dynamo's own Python guards used to be), which walks the model and inputs
    the way Dynamo's guard manager does.
    """

    def __init__(self, spec: dict[str, Any] | bytes, code: Any = None) -> None:
        """``spec``: the saved guard tree, or its pickle (unpickled only if it is used);
        ``code``: the check compiled at save (:mod:`.pycode`), with the emission it
        compiled (:func:`prepared`); each is used where it fits, else made here.

        ``spec`` is not kept: a re-save writes the section it was read from again
        (``LeanCompiledFunction.lean_section``), and kept, a 24-layer generator's five
        trees were 100,000 lists for the cyclic collector to walk."""
        emitted = _saved_emission(code)
        if emitted is None:
            tree = pickle.loads(spec) if isinstance(spec, bytes) else spec
            emitted = _Emitter(tree).emitted()
        self.emitted = emitted
        self._alias_groups = emitted.alias_groups
        self._same_groups = emitted.same_groups
        # Tensor leaves are collected by the generated code (``T.append``) and
        # checked together: (python type, dtype, requires_grad, size, stride,
        # dispatch keys) of each, in the order the code appends them.
        self._tensor_checks = emitted.tensor_checks
        namespace: dict[str, Any] = {
            **emitted.consts,
            "tf_stack_len": torch._C._len_torch_function_stack,
            "top_hooks": torch._C._autograd._top_saved_tensors_default_hooks,
            "named_class": named_class,
            "global_state_at_any_threads": global_state_at_any_threads,
            "torch": torch,  # torch.sym_max / sym_min in shape guards (ints here)
            "object": MethodRead,  # object.__getattribute__(x, name) in aliasing guards
            # The types a spec names, by name (not among the constants: a method's type
            # cannot be pickled with them).
            **{_type_global(name): cls for name, cls in LEAN_TYPES.items()},
        }
        from torch.utils import _device

        namespace["utils_device"] = _device
        self.namespace = dict(namespace)  # what ``source`` reads besides its arguments
        exec(code_for(emitted.source, GUARDS_FILENAME, code), namespace)
        self._fn = namespace["lean_check"]
        self.source = emitted.source
        # Dynamo compares a tensor's dispatch keys under the thread-local state of
        # the capture, not of the call. That state is found again by trying both
        # inference modes: the one under which tensors with the recorded properties
        # get the recorded keys is where tensor checks run (None: neither, so the
        # Python check runs in the call's own state, which is stricter).
        self._tensor_guards: Any = None
        self._tensor_inference_mode: bool | None = None
        for mode in (torch.is_inference_mode_enabled(), not torch.is_inference_mode_enabled()):
            with torch.inference_mode(mode):
                examples = self._examples_with_recorded_keys()
                if examples is not None:
                    self._tensor_inference_mode = mode
                    self._tensor_guards = self._native_tensor_guards(examples)
                    break

    def check(self, f_locals: dict[str, Any]) -> bool:
        seen: dict[str, Any] = {}
        tensors: list[Any] = []
        try:
            if not self._fn(f_locals, seen, tensors):
                return False
        except (KeyError, AttributeError, TypeError, IndexError, ValueError):
            return False
        return self.collected_ok(seen, tensors)

    def why_not(self, f_locals: dict[str, Any]) -> str:
        """Why :meth:`check` refuses ``f_locals``, in one line (for the log; slow path)."""
        lines = self.source.splitlines()
        # The same function, returning the number of the line that failed.
        numbered = [
            line.replace(": return False", f": return {i}") if ": return False" in line else line
            for i, line in enumerate(lines)
        ]
        numbered[-1] = numbered[-1].replace("return True", "return None")
        namespace = dict(self.namespace)
        exec(compile("\n".join(numbered), "<lean guards: why>", "exec"), namespace)
        seen: dict[str, Any] = {}
        tensors: list[Any] = []
        try:
            failed = namespace["lean_check"](f_locals, seen, tensors)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if failed is not None:
            return lines[failed].strip()
        inc = torch._C._dispatch_tls_local_include_set()
        exc = torch._C._dispatch_tls_local_exclude_set()
        for i, (t, check) in enumerate(zip(tensors, self._tensor_checks)):
            if not _tensor_ok(t, check, inc, exc):
                cls, dtype, grad, size, stride, _, device = check
                got = (
                    f"{type(t).__name__} {t.dtype} {tuple(t.size())} {t.stride()} {t.device}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                want = f"{cls.__name__} {dtype} {size} {stride} device {device} grad {grad}"
                return f"tensor {i}: expected {want} (and dispatch keys), got {got}"
        return "aliasing between inputs"

    def collected_ok(self, seen: dict[str, Any], tensors: list[Any]) -> bool:
        """The tensors ``source`` collected (``T``), and the aliasing between the values
        it recorded (``seen``), against what the capture saw."""
        mode = self._tensor_inference_mode
        if mode is None or mode == torch.is_inference_mode_enabled():
            tensors_ok = self._tensors_ok(tensors)
        else:
            with torch.inference_mode(mode):
                tensors_ok = self._tensors_ok(tensors)
        if not tensors_ok:
            return False
        for group in self._alias_groups:
            tensors = [seen.get(src) for src in group]
            if any(t is None for t in tensors) or len({id(t) for t in tensors}) != len(tensors):
                return False
            if _overlapping(tensors):
                return False
        for group in self._same_groups:
            first = seen.get(group[0], seen)  # ``seen`` itself: never a recorded value
            if first is seen or any(seen.get(src, seen) is not first for src in group[1:]):
                return False
        return True

    def _check_tensors(self, tensors: list[Any]) -> bool:
        """Each collected tensor against its recorded properties, in Python."""
        inc = torch._C._dispatch_tls_local_include_set()
        exc = torch._C._dispatch_tls_local_exclude_set()
        return all(
            _tensor_ok(t, check, inc, exc)
            for t, check in zip(tensors, self._tensor_checks, strict=True)
        )

    def _tensors_ok(self, tensors: list[Any]) -> bool:
        native = self._tensor_guards
        return (native is not None and native.check(*tensors)) or self._check_tensors(tensors)

    def _examples_with_recorded_keys(self) -> list[torch.Tensor] | None:
        """Empty tensors with the recorded properties, if under the current thread-local
        state they get the recorded dispatch keys (None otherwise)."""
        inc = torch._C._dispatch_tls_local_include_set()
        exc = torch._C._dispatch_tls_local_exclude_set()
        examples = []
        for cls, dtype, requires_grad, size, _, raw, device in self._tensor_checks:
            # Only the class, dtype, device, requires_grad and dimension count matter
            # (sizes and strides are given to TensorGuards apart): no memory.
            t = torch.empty(
                (0,) * len(size), dtype=dtype, device="cpu" if device is None else device
            )
            if cls is torch.nn.Parameter:
                t = torch.nn.Parameter(t, requires_grad=requires_grad)
            elif requires_grad:
                t.requires_grad_(True)
            if ((torch._C._dispatch_keys(t) | inc) - exc).raw_repr() != raw:
                return None
            examples.append(t)
        return examples

    def _native_tensor_guards(self, examples: list[torch.Tensor]) -> Any:
        """PyTorch's C++ ``TensorGuards`` over all collected tensors, or None.

        It checks the same properties as ``_check_tensors`` in one call (a
        fraction of a microsecond per tensor), and is also stricter: it fails
        when one tensor object appears twice (tied weights, the same input
        passed twice), in which case ``_check_tensors`` decides. Built from
        ``examples`` (which got the recorded keys), so under the same
        thread-local state both checks accept exactly the same tensors.
        """
        checks = self._tensor_checks
        if not checks:
            return None
        try:
            return torch._C._dynamo.guards.TensorGuards(  # type: ignore[attr-defined]
                *examples,
                dynamic_dims_sizes=[list(c[3]) for c in checks],
                dynamic_dims_strides=[list(c[4]) for c in checks],
            )
        except Exception as exc:  # another PyTorch's signature: the Python check decides
            logging.getLogger("torch_precompile").debug("no native tensor guards: %s", exc)
            return None


class _Emitter:
    """Writes a spec's check as Python (:class:`Emitted`): one walk of the tree."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._alias_groups: list[list[str]] = []
        self._same_groups: list[list[str]] = []
        self._collect_alias_groups(spec)
        self._alias_sources = {
            src for group in self._alias_groups + self._same_groups for src in group
        }
        self._consts: dict[str, Any] = {}
        self._lines: list[str] = []
        self._n = 0
        self._tensor_checks: list[_TensorCheck] = []
        self._emit_node(spec, "L", 1)
        for expr in spec.get("shape_guards", ()):
            if not shape_expr_ok(ast.parse(expr, mode="eval")):
                raise ValueError(f"shape guard outside the lean grammar: {expr!r}")
            self._fail_unless(expr)

    def emitted(self) -> Emitted:
        body = "\n".join(self._lines)
        source = f"def lean_check(L, seen, T):\n{body}\n    return True\n"
        return Emitted(
            source, self._consts, self._tensor_checks, self._alias_groups, self._same_groups
        )

    def _collect_alias_groups(self, node: dict[str, Any]) -> None:
        for leaf in node["leaves"]:
            if leaf[0] == "no_aliasing" and leaf[1] not in self._alias_groups:
                self._alias_groups.append(leaf[1])
            elif leaf[0] == "same_object" and leaf[1] not in self._same_groups:
                self._same_groups.append(leaf[1])
        subs = [child for _, child in node["children"]]
        for _, k, v in (node.get("dict") or {}).get("entries", []):
            subs.extend(x for x in (k, v) if x is not None)
        for sub in subs:
            self._collect_alias_groups(sub)

    def _const(self, value: Any) -> str:
        name = f"k{len(self._consts)}"
        self._consts[name] = value
        return name

    def _var(self) -> str:
        self._n += 1
        return f"v{self._n}"

    def _fail_unless(self, cond: str) -> None:
        self._lines.append(f"    if not ({cond}): return False")

    def _emit_node(self, node: dict[str, Any], var: str, _depth: int) -> None:
        if node["source"] in self._alias_sources:
            self._lines.append(f"    seen[{self._const(node['source'])}] = {var}")
        for leaf in node["leaves"]:
            self._emit_leaf(leaf, var)
        d = node.get("dict")
        if d is not None:
            exact = "isinstance({}, dict)" if d.get("config") else "type({}) is dict"
            if d.get("ordered"):  # a module's hook dict
                exact = "type({}) is " + self._const(collections.OrderedDict)
            self._fail_unless(f"{exact.format(var)} and len({var}) == {int(d['size'])}")
            keys, values = self._var(), self._var()
            self._lines.append(f"    {keys} = list({var}); {values} = list({var}.values())")
            for i, k, v in d["entries"]:
                for sub, seq in ((k, keys), (v, values)):
                    if sub is not None:
                        item = self._var()
                        self._lines.append(f"    {item} = {seq}[{int(i)}]")
                        self._emit_node(sub, item, _depth + 1)
        # Children that must be empty and hold nothing else (a module's hook dicts, a
        # dozen per module) are checked in one expression: empty means falsy for the
        # dicts Dynamo guards this way, and the walk stays cheap.
        empty = [
            step[1]
            for step, child in node["children"]
            if step[0] == "item" and self._only_empty(child)
        ]
        if empty:
            self._lines.append(
                "    if "
                + " or ".join(f"{var}[{self._const(key)}]" for key in empty)
                + ": return False"
            )
        for step, child in node["children"]:
            if step[0] == "item" and self._only_empty(child):
                continue
            item = self._var()
            if step[0] == "vars":
                self._lines.append(f"    {item} = {var}.__dict__")
            elif step[0] == "attr":
                self._lines.append(f"    {item} = getattr({var}, {self._const(str(step[1]))})")
            elif step[0] == "oattr":
                name = self._const(str(step[1]))
                self._lines.append(f"    {item} = object.__getattribute__({var}, {name})")
            else:
                self._lines.append(f"    {item} = {var}[{self._const(step[1])}]")
            self._emit_node(child, item, _depth + 1)

    def _only_empty(self, node: dict[str, Any]) -> bool:
        """Whether ``node`` checks only that its value is empty (``len == 0``)."""
        return (
            node["leaves"] == [["len", 0]]
            and not node["children"]
            and node.get("dict") is None
            and node["source"] not in self._alias_sources
        )

    def _emit_leaf(self, leaf: list[Any], v: str) -> None:
        kind = leaf[0]
        if kind == "tensor":
            _, cls, keys_text, dtype_name, requires_grad, size, stride = leaf[:7]
            device = leaf[7] if len(leaf) > 7 else None
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name}")
            self._tensor_checks.append(
                (
                    torch.nn.Parameter if cls == "Parameter" else torch.Tensor,
                    dtype,
                    bool(requires_grad),
                    tuple(None if n is None else int(n) for n in size),
                    tuple(None if n is None else int(n) for n in stride),
                    # The raw bits (an older file: the key set's repr).
                    keys_text if type(keys_text) is int else _dispatch_key_set_raw(keys_text),
                    None if device is None else int(device),
                )
            )
            self._lines.append(f"    T.append({v})")
        elif kind == "no_dynamic_marking":
            attrs = frozenset(leaf[1])
            if any(hasattr(torch.Tensor, a) or hasattr(torch.nn.Parameter, a) for a in attrs):
                raise ValueError("tensor classes define a dynamic-marking attribute")
            # Plain tensors and parameters define none of these: only the instance
            # dict can hold them (cheaper than hasattr); anything else uses hasattr.
            a, plain = self._const(attrs), self._const((torch.Tensor, torch.nn.Parameter))
            self._fail_unless(
                f"{a}.isdisjoint({v}.__dict__) if type({v}) in {plain} "
                f"else not any(hasattr({v}, x) for x in {a})"
            )
            if len(leaf) > 2:  # dimensions marked dynamic at capture
                dims = self._const(frozenset(int(d) for d in leaf[2]))
                self._fail_unless(f"{dims}.issuperset(getattr({v}, '_dynamo_dynamic_indices', ()))")
        elif kind in ("no_aliasing", "same_object"):
            pass  # checked once every value is known
        elif kind == "type":
            if leaf[1] not in LEAN_TYPES:
                raise ValueError(f"unknown lean type {leaf[1]!r}")
            self._fail_unless(f"type({v}) is {_type_global(leaf[1])}")
        elif kind == "class":
            # The class of that name, looked up when checked: an instance of it
            # means its module is imported; nothing is imported here.
            module, qualname = self._const(str(leaf[1])), self._const(str(leaf[2]))
            self._fail_unless(f"named_class({module}, {qualname}) is type({v})")
        elif kind == "no_attr":
            self._fail_unless(f"not hasattr({v}, {self._const(str(leaf[1]))})")
        elif kind == "equals":
            expected = self._const(leaf[1])
            self._fail_unless(f"type({v}) is {self._const(type(leaf[1]))} and {v} == {expected}")
        elif kind == "is":
            self._fail_unless(f"{v} is {self._const(leaf[1])}")
        elif kind == "len":
            self._fail_unless(f"len({v}) == {int(leaf[1])}")
        elif kind == "contains":
            self._fail_unless(f"({self._const(leaf[1])} in {v}) is {bool(leaf[2])}")
        elif kind == "global_state" and len(leaf) > 2 and leaf[2].get("any_threads"):
            # Kernels that read the thread count as they run: the state at the call's count.
            self._fail_unless(f"global_state_at_any_threads({self._const(str(leaf[1]))})")
        elif kind == "global_state":
            guard = torch._C._dynamo.guards.GlobalStateGuard()  # type: ignore[attr-defined]
            guard.__setstate__(leaf[1])
            self._fail_unless(f"{self._const(guard)}.check()")
        elif kind == "no_torch_function_mode":
            self._fail_unless("tf_stack_len() == 0")
        elif kind == "no_default_device":
            self._fail_unless("utils_device.CURRENT_DEVICE is None")
        elif kind == "no_saved_tensor_hooks":
            self._fail_unless("top_hooks(True) is None")
        elif kind == "dtensor_spec":
            self._fail_unless(f"{self._const(DTensorSpecCheck(leaf[1]))}.ok({v})")
        elif kind == "mesh":
            self._fail_unless(f"{self._const(MeshCheck(leaf[1]))}.ok({v})")
        else:
            raise ValueError(f"unknown lean guard {kind!r}")


def _type_global(name: str) -> str:
    """The check's global for ``LEAN_TYPES[name]`` (``torch.Size``: ``type_torch_Size``)."""
    return "type_" + name.replace(".", "_")


def prepared(guards: LeanGuards) -> bytes | None:
    """What the save keeps of ``guards``' emission, for a load to skip it (None when
    some constant cannot be pickled: the load then emits)."""
    emitted = guards.emitted
    fields = {f.name: getattr(emitted, f.name) for f in dataclasses.fields(emitted)}
    try:
        return dumps({"version": EMITTED_VERSION, **fields})
    except Exception as exc:  # an optional speed-up of the load
        logging.getLogger("torch_precompile").debug("lean guards' emission not kept: %s", exc)
        return None


def _saved_emission(code: Any) -> Emitted | None:
    """The emission the save kept beside the compiled check, if of this version."""
    blob = code.get("prepared") if isinstance(code, dict) else None
    if not isinstance(blob, bytes):
        return None
    try:
        saved = pickle.loads(blob)
    except Exception:  # another version's objects: emit instead
        return None
    if not isinstance(saved, dict) or saved.pop("version", None) != EMITTED_VERSION:
        return None
    try:
        return Emitted(**saved)
    except TypeError:
        return None


def _overlapping(tensors: list[Any]) -> bool:
    """Whether two of ``tensors`` share memory.

    Dynamo's own check is object identity; the compiled graph also assumes
    distinct inputs do not overlap, so overlapping memory is refused too. Views
    of one block that do not overlap (the weights of a file read as one block)
    pass.
    """
    spans = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        numel = t.numel()
        if numel == 0:
            continue
        # A contiguous tensor spans its numel (size-1 dimensions add nothing).
        extent = (
            numel
            if t.is_contiguous()
            else sum((n - 1) * abs(s) for n, s in zip(t.size(), t.stride())) + 1
        )
        start = t.data_ptr()
        device = t.device
        spans.append((device.type, device.index or 0, start, start + extent * t.element_size()))
    spans.sort()
    return any(a[:2] == b[:2] and b[2] < a[3] for a, b in itertools.pairwise(spans))


def _tensor_ok(t: Any, check: _TensorCheck, inc: Any, exc: Any) -> bool:
    """One collected tensor against its recorded properties (``inc``/``exc``: the
    thread's local dispatch key sets)."""
    cls, dtype, requires_grad, size, stride, raw, device = check
    return (
        type(t) is cls
        and t.dtype is dtype
        and (t.is_cpu if device is None else t.is_cuda and t.get_device() == device)
        and t.requires_grad is requires_grad
        and (t.size() == size if None not in size else _same_dims(t.size(), size))
        and (t.stride() == stride if None not in stride else _same_dims(t.stride(), stride))
        and ((torch._C._dispatch_keys(t) | inc) - exc).raw_repr() == raw
    )


def _dispatch_key_set_raw(text: str) -> int:
    """The raw bits of a DispatchKeySet from its repr, checked to round-trip."""
    names = [n.strip() for n in text[len("DispatchKeySet(") : -1].split(",") if n.strip()]
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for name in names:
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    if repr(keys) != text:
        raise ValueError(f"cannot rebuild {text}")
    return keys.raw_repr()
