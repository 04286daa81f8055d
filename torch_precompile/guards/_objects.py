"""Guards on objects: identities of code, index ranges, module hooks, and what was dropped."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .. import _compat
from ._base import Call, Guard, Reader
from ._identity import Identity, identity_of
from ._python import Code, Parts, fstring, render
from ._source import MISSING, ROOT_SOURCE, UNRESOLVED, Source, describe_source

# ----------------------------------------------------- identity, index, hooks


@dataclasses.dataclass(frozen=True)
class IdentityGuard(Guard):
    """A function, class or module the traced code used, identified across processes."""

    source: str = ""
    identity: Identity | None = None
    scope_module: str | None = None
    # (distribution, version) of the library a global is read from, at capture.
    library: tuple[str, str] | None = None
    kind: ClassVar[str] = "identity"

    @property
    def subject(self) -> str:
        return self.source

    @property
    def where(self) -> str:
        return self.expr.split(" is ", 1)[0]

    def check_value(self, value: Any) -> str | None:
        """Why ``value`` is not the identity this guard expects, or None."""
        if value is UNRESOLVED:
            return None
        if value is MISSING:
            return f"{self.where}: missing, expected {self.identity}"
        found = identity_of(value)
        if found != self.identity:
            return render(self._mismatch(str(found) if found else f"a {type(value).__name__}"))
        return None

    def _mismatch(self, got: str) -> Parts:
        return [
            f"{self.where}: expected {self.identity}, got ", got,
            "; the code Dynamo traced has changed, capture again",
        ]  # fmt: skip

    def python(self, read: Reader) -> list[str] | None:
        x = read(self.source) if self.source.startswith("L[") else None
        if x is None:
            return None
        return [
            f"if identity_of({x}) != {self.identity!r}:",
            "    " + self.raise_line(self._mismatch(Code(f"describe_identity({x})"))),
        ]

    def problem(self, call: Call) -> str | None:
        source = Source.parse(self.source)
        if source is None:
            return None
        return self.check_value(source.resolve(call.f_locals, {}, self.scope_module))

    @classmethod
    def _from_typed(cls, data: Mapping[str, Any]) -> Guard:
        identity = Identity.from_json(data["identity"])
        library = data.get("library")
        return cls(
            data["phase"],
            data["expr"],
            data["source"],
            identity,
            data.get("scope_module"),
            (str(library[0]), str(library[1])) if library else None,
        )

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        e = dict(data["expected"])
        scope = e.pop("scope", None)
        return cls(data["phase"], data["expr"], data["subject"], Identity.from_json(e), scope)


@dataclasses.dataclass(frozen=True)
class IndexGuard(Guard):
    """An index input: values in ``[min, max)``, else IndexError (as eager) before the call."""

    source: str = ""
    min: int = 0
    max: int = 0
    uses: tuple[str, ...] = ()
    kind: ClassVar[str] = "index"

    @property
    def subject(self) -> str:
        return self.source

    def out_of_range(self, got_min: str, got_max: str) -> Parts:
        return [
            f"{describe_source(self.source)}: index out of range: values must be in "
            f"[{self.min}, {self.max}) ({'; '.join(self.uses)}), got values in [", got_min, ", ",
            got_max, "]",
        ]  # fmt: skip

    def python(self, read: Reader) -> list[str] | None:
        x = read(self.source)
        if x is None:
            return None
        msg = self.out_of_range(Code("int(lo)"), Code("int(hi)"))
        return [
            f"if {x}.device.type == 'cpu' and {x}.numel() and not "
            f"({x}.is_floating_point() or {x}.is_complex() or {x}.dtype == torch.bool):",
            f"    lo, hi = torch.aminmax({x})",
            f"    if lo < {self.min} or hi >= {self.max}:",
            f"        raise IndexError({fstring(msg)})",
        ]

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        e = data["expected"]
        return cls(
            data["phase"], data["expr"], data["subject"], int(e["min"]), int(e["max"]),
            tuple(e.get("uses", ())),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ExtentGuard(Guard):
    """Positions computed from sizes (``arange(past, past + length)``) that index a
    table: the largest, ``sum(coefficient * size) + constant``, must be below ``max``,
    else IndexError (as eager) before the call. ``terms`` are ``(source, dim,
    coefficient)``: a dimension of an input holding each size."""

    terms: tuple[tuple[str, int, int], ...] = ()
    constant: int = 0
    max: int = 0
    uses: tuple[str, ...] = ()
    kind: ClassVar[str] = "extent"

    @property
    def subject(self) -> str:
        return self.terms[0][0] if self.terms else ""

    def reached(self, sizes: Sequence[int]) -> int:
        """The largest position a call with these sizes (one per term) reaches."""
        return sum(c * n for (_, _, c), n in zip(self.terms, sizes)) + self.constant

    def past_end(self, reached: str, sizes: Sequence[str]) -> Parts:
        parts: Parts = ["positions up to ", reached, " (from "]
        for i, ((source, dim, coeff), size) in enumerate(zip(self.terms, sizes)):
            sign = "" if i == 0 and coeff > 0 else (" + " if coeff > 0 else " - ")
            times = "" if abs(coeff) == 1 else f"{abs(coeff)} * "
            parts += [f"{sign}{times}dimension {dim} of {describe_source(source)} = ", size]
        if self.constant:
            parts.append(f" {'+' if self.constant > 0 else '-'} {abs(self.constant)}")
        return [
            *parts,
            f") index past the end of a table of {self.max} ({'; '.join(self.uses)}): "
            f"this model takes at most {self.max} positions; send a shorter input or cache",
        ]

    def python(self, read: Reader) -> list[str] | None:
        names = [read(source) for source, _, _ in self.terms]
        if not names or any(n is None for n in names):
            return None
        sizes = [f"{n}.shape[{dim}]" for n, (_, dim, _) in zip(names, self.terms)]
        reached = " + ".join(f"{c} * {s}" for s, (_, _, c) in zip(sizes, self.terms))
        msg = self.past_end(Code("reached"), [Code(s) for s in sizes])
        return [
            f"reached = {reached} + {self.constant}",
            f"if reached >= {self.max}:",
            f"    raise IndexError({fstring(msg)})",
        ]


@dataclasses.dataclass(frozen=True)
class HooksGuard(Guard):
    """Module hooks the compiled code would not run: on the model, the submodules it
    calls and globally, none may be registered."""

    modules: tuple[str, ...] = ()
    kind: ClassVar[str] = "hooks"

    @classmethod
    def of(cls, modules: tuple[str, ...], root_is_module: bool) -> HooksGuard:
        n = len(modules)
        parts = ["the model"] if root_is_module else []
        if n:
            parts.append(f"the {n} submodule{'s' if n != 1 else ''} the compiled code calls")
        verb = "have" if len(parts) > 1 else "has"
        expr = (
            f"no module hooks: {' and '.join(parts)} {verb} no forward, forward pre-, backward or "
            "backward pre-hook, and no global module hook is registered (checked at each call: "
            "the compiled code would not run them)"
        )
        return cls("dynamo", expr, ((ROOT_SOURCE,) if root_is_module else ()) + tuple(modules))

    @property
    def subject(self) -> str | None:
        return ROOT_SOURCE if ROOT_SOURCE in self.modules else None

    NO_HOOKS_RUN: ClassVar[str] = (
        "a module hook is registered on the model or globally, and the compiled code runs no "
        "module hooks; remove it (handle.remove()) before calling the artifact"
    )

    def problem(self, call: Call) -> str | None:
        scope = call.f_locals
        for src in self.modules:
            parsed = Source.parse(src)
            module = parsed.resolve(scope) if parsed is not None else MISSING
            if module is MISSING:
                continue
            hooks = _compat.registered_hooks(module)
            if not hooks:
                continue
            words, hook = hooks[0]
            if src == ROOT_SOURCE:
                return (
                    f"the model has a {words} ({_hook_name(hook)}): the artifact runs the "
                    "compiled forward without the model's hooks, so it would not run it; remove "
                    "the hook (handle.remove()) and do its work around the call, or call the "
                    "model eagerly while it is registered"
                )
            what = describe_source(src)
            if _hook_name(hook).startswith(_OUTPUT_CAPTURING):
                return (
                    f"{what} has a {words} ({_hook_name(hook)}) that transformers installs "
                    "on every layer the first time the model runs with output_attentions or "
                    "output_hidden_states (eager generate(output_attentions=True), say) and "
                    "never removes; the compiled code runs no hooks: give the artifact a model "
                    "that has not run with those outputs (load with model= another instance, "
                    "or without model=), and keep that instance for the eager calls that "
                    "need attentions"
                )
            return (
                f"{what} has a {words} ({_hook_name(hook)}): the compiled code calls {what} "
                "without hooks (none was registered at capture), so it would not run it; remove "
                "the hook (handle.remove()) before calling the artifact, or register it before "
                "capturing and capture again"
            )
        hooks = _compat.registered_global_hooks()
        if hooks:
            words, hook = hooks[0]
            return (
                f"a {words} is registered ({_hook_name(hook)}): it would run on every module "
                "call, and the compiled code runs no module hooks; remove it (handle.remove()) "
                "while the artifact serves calls, or call the model eagerly"
            )
        return None

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], tuple(str(s) for s in data["expected"] or ()))


# The forward hooks Hugging Face transformers installs to collect attentions and
# hidden states (it leaves them on the model).
_OUTPUT_CAPTURING = "transformers.utils.output_capturing."


def _hook_name(hook: Any) -> str:
    fn = getattr(hook, "__func__", hook)
    qualname = getattr(fn, "__qualname__", None) or type(hook).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


@dataclasses.dataclass(frozen=True)
class DroppedGuard(Guard):
    """Dynamo guards that are not re-checked after load, each as ``KIND name: category``."""

    entries: tuple[str, ...] = ()
    kind: ClassVar[str] = "dropped"

    @classmethod
    def _from_untyped(cls, data: Mapping[str, Any]) -> Guard:
        return cls(data["phase"], data["expr"], tuple(data["expected"] or ()))
