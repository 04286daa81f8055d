"""Guards on values: tensors, Python values, process state, the machine, grad mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from .. import _compat
from ._base import Call, Guard, Reader, _frozen, _resolve
from ._python import Code, Parts, dtype_name, literal, plain, render, shape_text
from ._source import MISSING, describe_source

# ------------------------------------------------------------------ tensors


@dataclasses.dataclass(frozen=True)
class TensorGuard(Guard):
    """dtype, shape (a symbol name for a dynamic size), device and requires_grad of a tensor."""

    source: str = ""
    dtype: str = ""
    shape: tuple[int | str, ...] = ()
    device: str = ""
    requires_grad: bool = False
    kind: ClassVar[str] = "tensor"

    @classmethod
    def of(cls, source: str, value: torch.Tensor, dynamic: Mapping[int, str]) -> TensorGuard:
        shape = tuple(dynamic.get(i) or int(s) for i, s in enumerate(value.shape))
        t = cls(
            "dynamo", "", source, dtype_name(value.dtype), shape, str(value.device),
            bool(value.requires_grad),
        )  # fmt: skip
        grad = ", requires_grad" if t.requires_grad else ""
        expr = f"{t.what}: {t.dtype} {shape_text(shape)} on {t.device}{grad}"
        return dataclasses.replace(t, expr=expr)

    @property
    def subject(self) -> str:
        return self.source

    @property
    def what(self) -> str:
        return describe_source(self.source)

    def problem(self, call: Call) -> str | None:
        value = _resolve(self.source, call)
        if value is MISSING:
            return render(self._missing())
        if not isinstance(value, torch.Tensor):
            return render(self._not_tensor(type(value).__name__))
        if dtype_name(value.dtype) != self.dtype:
            return render(self._dtype(dtype_name(value.dtype)))
        device = str(value.device) if ":" in self.device else value.device.type
        if device != self.device:
            return render(self._device(device))
        if value.dim() != len(self.shape):
            return render(self._dims(str(value.dim()), shape_text(tuple(value.shape))))
        if any(isinstance(w, int) and w != g for w, g in zip(self.shape, value.shape)):
            return render(self._shape(shape_text(tuple(value.shape))))
        if bool(value.requires_grad) != self.requires_grad:
            return render(self._requires_grad())
        return None

    def _device_expr(self, x: str) -> str:
        # Recorded with its index (cuda:0) since format 2; version-1 files: the type.
        return f"str({x}.device)" if ":" in self.device else f"{x}.device.type"

    @property
    def _is_input(self) -> bool:
        return self.what.startswith("input ")

    def _fix(self, for_input: str) -> str:
        """What to do, after a mismatch: the caller's move for an input; for the
        model's own tensors, that it is not the model captured."""
        if self._is_input:
            return f"; {for_input}"
        return "; the model is not the one the artifact was captured from (or was changed since)"

    def _missing(self) -> Parts:
        return [f"{self.what}: expected a tensor, but it is missing; pass it, as the capture did"]

    def _not_tensor(self, got: str) -> Parts:
        return [f"{self.what}: expected a tensor, got ", got, self._fix("pass a tensor")]

    def _dtype(self, got: str) -> Parts:
        return [
            f"{self.what}: expected dtype {self.dtype}, got ", got,
            self._fix(f"pass a tensor of dtype {self.dtype}, or capture again with this dtype"),
        ]  # fmt: skip

    def _device(self, got: str) -> Parts:
        return [
            f"{self.what}: expected device {self.device}, got ", got,
            self._fix(f"move it to {self.device}, or capture again on that device"),
        ]  # fmt: skip

    def _dims(self, got: str, got_shape: str) -> Parts:
        n = len(self.shape)
        return [f"{self.what}: expected {n} dimensions {shape_text(self.shape)}, got ", got, " ",
                got_shape, self._fix(f"pass a tensor of {n} dimensions")]  # fmt: skip

    def _shape(self, got: str) -> Parts:
        return [
            f"{self.what}: expected shape {shape_text(self.shape)}, got ", got,
            self._fix(
                "capture with dynamic=True (or torch._dynamo.mark_dynamic on that dimension) to "
                "serve other sizes"
            ),
        ]  # fmt: skip

    def _requires_grad(self) -> Parts:
        said = "does not require grad" if self.requires_grad else "requires grad"
        return [
            f"{self.what}: {said}, but the artifact was captured with "
            f"requires_grad={self.requires_grad}; capture again with the same requires_grad "
            "settings"
        ]

    def python(self, read: Reader) -> list[str] | None:
        x = read(self.source)
        if x is None:
            return None
        static = [(i, s) for i, s in enumerate(self.shape) if isinstance(s, int)]
        lines = [
            f"if not isinstance({x}, torch.Tensor):",
            "    " + self.raise_line(self._not_tensor(Code(f"type({x}).__name__"))),
            f"if {x}.dtype != torch.{self.dtype}:",
            "    " + self.raise_line(self._dtype(Code(f"dtype_name({x}.dtype)"))),
            f"if {self._device_expr(x)} != {self.device!r}:",
            "    " + self.raise_line(self._device(Code(self._device_expr(x)))),
            f"if {x}.dim() != {len(self.shape)}:",
            "    " + self.raise_line(self._dims(Code(f"{x}.dim()"), Code(f"tuple({x}.shape)"))),
        ]
        if static:
            if len(static) == len(self.shape):
                cond = f"{x}.shape != {tuple(self.shape)!r}"
            else:
                cond = " or ".join(f"{x}.shape[{i}] != {s}" for i, s in static)
            lines += [
                f"if {cond}:",
                "    " + self.raise_line(self._shape(Code(f"tuple({x}.shape)"))),
            ]
        lines += [
            f"if {'not ' if self.requires_grad else ''}{x}.requires_grad:",
            "    " + self.raise_line(self._requires_grad()),
        ]
        return lines

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        exp = data["expected"]
        return cls(
            data["phase"], data["expr"], data["subject"], exp["dtype"], tuple(exp["shape"]),
            exp["device"], bool(exp["requires_grad"]),
        )  # fmt: skip


_BAKED = "; Python values are baked into the compiled code, capture again with the new value"


@dataclasses.dataclass(frozen=True)
class ValueGuard(Guard):
    """A Python value the compiled code specialised on (an int, a flag, a dtype by name)."""

    source: str = ""
    value: Any = None
    kind: ClassVar[str] = "value"

    @classmethod
    def of(cls, source: str, value: Any) -> ValueGuard:
        value = plain(value)
        return cls("dynamo", f"{describe_source(source)} == {value!r}", source, value)

    @property
    def subject(self) -> str:
        return self.source

    def problem(self, call: Call) -> str | None:
        value = _resolve(self.source, call)
        if value is MISSING:
            return render(self._missing())
        if isinstance(value, torch.Tensor):  # compared below, it would raise or broadcast
            shape = tuple(value.shape)
            return render(self._differs(f"a tensor {dtype_name(value.dtype)} {shape}"))
        if plain(value) != self.value:
            return render(self._differs(repr(plain(value))))
        return None

    def _missing(self) -> Parts:
        return [f"{describe_source(self.source)}: missing, expected {self.value!r}"]

    def _differs(self, got: str) -> Parts:
        return [f"{describe_source(self.source)}: expected {self.value!r}, got ", got, _BAKED]

    def missing_message(self) -> str:
        return f"{render(self._missing())} [{self.phase}]"

    def python(self, read: Reader) -> list[str] | None:
        x, expected = read(self.source), literal(self.value)
        if x is None or expected is None:
            return None
        cond = f"{x} is not None" if expected == "None" else f"plain({x}) != {expected}"
        return [f"if {cond}:", "    " + self.raise_line(self._differs(Code(f"plain({x})!r")))]

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], data["subject"], _frozen(data["expected"]))


# --------------------------------------------------------- process state

# Dynamo guards the process-wide state; say how to meet it without a new capture.
_GLOBAL_HINTS = {
    "num threads": (
        "; Dynamo guards torch.get_num_threads(): call torch.set_num_threads() with the "
        "captured value, or capture where the thread count is the one you deploy with"
    ),
    "default dtype": "; call torch.set_default_dtype() with the captured dtype",
}


@dataclasses.dataclass(frozen=True)
class GlobalStateGuard(Guard):
    """Process-wide state the capture ran under (default dtype, thread count, ...)."""

    name: str = ""
    value: Any = None
    kind: ClassVar[str] = "global"

    @classmethod
    def of(cls, name: str, value: Any) -> GlobalStateGuard:
        return cls("dynamo", f"{name} == {value}", name, value)

    def problem(self, call: Call) -> str | None:
        now = _compat.global_state_snapshot().get(self.name)
        if now is not None and now != self.value:
            return render(self._differs(str(now)))
        return None

    def _differs(self, got: str) -> Parts:
        return [f"{self.name}: expected {self.value}, got ", got, _GLOBAL_HINTS.get(self.name, "")]

    def python(self, read: Reader) -> list[str] | None:
        now = f"global_state()[{self.name!r}]"
        return [
            f"if {now} != {literal(self.value) or repr(str(self.value))}:",
            "    " + self.raise_line(self._differs(Code(now))),
        ]

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], data["subject"], data["expected"])


@dataclasses.dataclass(frozen=True)
class SystemGuard(Guard):
    """What the kernels assume of the machine (device type, versions, ISA, capability);
    checked once, when the file is loaded."""

    key: str = ""
    value: Any = None
    kind: ClassVar[str] = "system"

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], data["subject"] or "", data["expected"])


@dataclasses.dataclass(frozen=True)
class AutogradGuard(Guard):
    """Training (joint graph, outputs with grad_fn) or inference (no autograd)."""

    training: bool = False
    kind: ClassVar[str] = "autograd"

    @classmethod
    def of(cls, training: bool) -> AutogradGuard:
        if training:
            expr = "training artifact: call with grad enabled (outputs carry grad_fn)"
        else:
            expr = (
                "inference artifact: runs without autograd; "
                "with grad enabled, nothing it reads may require grad"
            )
        return cls("aot_autograd", expr, training)

    @property
    def subject(self) -> str:
        return "grad mode"

    TRAINING_UNDER_NO_GRAD: ClassVar[str] = (
        "grad mode: captured with grad enabled (a training artifact), called under "
        "torch.no_grad(); capture again under torch.no_grad() for an inference artifact"
    )

    @staticmethod
    def inference_under_grad(culprit: str) -> str:
        """An inference artifact called with grad enabled while ``culprit`` requires grad."""
        return (
            "grad mode: this is an inference artifact (captured under torch.no_grad()), "
            f"called with grad enabled while {culprit} requires grad; call it under "
            "torch.no_grad(), or capture again with grad enabled for a training artifact"
        )

    def problem(self, call: Call) -> str | None:
        # An inference artifact runs in the grad mode it was captured in (the
        # runtime switches, or refuses first when something requires grad).
        if self.training and not call.grad_enabled:
            return self.TRAINING_UNDER_NO_GRAD
        return None

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], bool(data["expected"]))
