"""Lean guards, at load: the saved spec as a plain-Python check that needs no Dynamo."""

from __future__ import annotations

import itertools
import logging
import pickle
from typing import Any

import torch

from .guard_emit import Emitter, type_global
from .guard_schema import EMITTED_VERSION, Emitted, GuardTree, TensorCheck
from .guard_types import LEAN_TYPES, MethodRead, global_state_at_any_threads, named_class
from .pickling import dumps
from .pycode import code_for

__all__ = ["EMITTED_VERSION", "GUARDS_FILENAME", "LeanGuards", "prepared"]

GUARDS_FILENAME = "<torch_precompile lean guards>"


def _same_dims(actual: Any, expected: tuple[int | None, ...]) -> bool:
    return len(actual) == len(expected) and all(
        e is None or a == e for a, e in zip(actual, expected)
    )


class LeanGuards:
    """The lean check: plain Python over ``torch`` and ``torch._C``, no ``torch._dynamo``.

    The saved tree is turned once into one straight-line Python function (as
    Dynamo's own Python guards used to be), which walks the model and inputs
    the way Dynamo's guard manager does.
    """

    def __init__(
        self,
        spec: GuardTree | dict[str, Any] | bytes,
        code: Any = None,
        prepared: bytes | None = None,
    ) -> None:
        """``spec``: the guard tree, its stored form or that form's pickle (unpickled
        only if it is used); ``code``: the check compiled at save (:mod:`.pycode`);
        ``prepared``: the emission it compiled (:func:`prepared`); each is used where
        it fits, else made here.

        ``spec`` is not kept: a re-save writes the section it was read from again
        (``LeanCompiledFunction.lean_section``), and kept, a 24-layer generator's five
        trees were 100,000 lists for the cyclic collector to walk."""
        emitted = _saved_emission(prepared)
        if emitted is None:
            tree = pickle.loads(spec) if isinstance(spec, bytes) else spec
            if not isinstance(tree, GuardTree):
                tree = GuardTree.read(tree)
            emitted = Emitter(tree).emitted()
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
            **{type_global(name): cls for name, cls in LEAN_TYPES.items()},
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


def prepared(guards: LeanGuards) -> bytes | None:
    """What the save keeps of ``guards``' emission, for a load to skip it (None when
    some constant cannot be pickled: the load then emits)."""
    try:
        return dumps(guards.emitted.write())
    except Exception as exc:  # an optional speed-up of the load
        logging.getLogger("torch_precompile").debug("lean guards' emission not kept: %s", exc)
        return None


def _saved_emission(blob: bytes | None) -> Emitted | None:
    """The emission the save kept beside the compiled check, if of this version."""
    if not isinstance(blob, bytes):
        return None
    try:
        saved = pickle.loads(blob)
    except Exception:  # another version's objects: emit instead
        return None
    return Emitted.read(saved)


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


def _tensor_ok(t: Any, check: TensorCheck, inc: Any, exc: Any) -> bool:
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
