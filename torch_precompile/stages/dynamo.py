"""Stage 1: Dynamo captures the model's forward as one FX graph, with guards."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from .. import _compat
from .._compat.pytree import tree_leaves
from .._errors import CaptureError
from ..distributed.tracing import one_rank_tracing, traced_on_one_rank
from ..guards import Guards, capture_guards, describe_source
from ..runtime.signature import describe_inputs
from .handoff import CaptureState, Handoff, count_outputs, hand_out, stage_timings

log = logging.getLogger("torch_precompile")


@dataclasses.dataclass(frozen=True)
class DynamoOutput:
    """The captured FX graph, Dynamo's transformed bytecode and the guards.

    Unpacks to ``(graph_module, bytecode, guards)``.
    """

    graph_module: torch.fx.GraphModule
    bytecode: types.CodeType
    guards: Guards
    _handoff: Handoff = dataclasses.field(repr=False, compare=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.graph_module, self.bytecode, self.guards))

    @property
    def input_sources(self) -> list[str]:
        """Where each graph input comes from (``L['x']``, ``L['self'].l1.weight``)."""
        return list(self._handoff.state.capture.input_sources)

    @property
    def training(self) -> bool:
        """Whether the capture will produce a training (joint) artifact."""
        return self._handoff.training

    def as_text(self) -> str:
        """The FX graph code and the source of each graph input (for reading, not parsing)."""
        lines = ["# Dynamo graph inputs:"]
        placeholders = [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        for node, source in zip(placeholders, self.input_sources):
            lines.append(f"#   {node.name:<40} <- {source}  ({describe_source(source)})")
        lines.append(f"# kind: {'training' if self.training else 'inference'}")
        lines.append(self.graph_module.code.strip())
        return "\n".join(lines)


def normalize_inputs(example_inputs: Any) -> tuple[Any, ...]:
    """A tuple is the argument list (as in torch.export); anything else is one argument."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    return (example_inputs,)


def _traceable(model: Any) -> Any:
    """What Dynamo can trace: modules, Python functions and bound methods as they are."""
    if isinstance(model, torch.nn.Module) or inspect.isfunction(model) or inspect.ismethod(model):
        return model
    if inspect.isfunction(getattr(type(model), "__call__", None)):  # noqa: B004
        return model.__call__  # an object whose class defines __call__ in Python

    # Builtins, functools.partial and other C callables: trace a Python shim.
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    return call


def _wants_grad(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if not torch.is_grad_enabled():
        return False
    leaves = tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return True
    owner = _owner(model)
    return owner is not None and any(p.requires_grad for p in owner.parameters())


def _owner(model: Any) -> torch.nn.Module | None:
    owner = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def refuse_nested_fast_path(model: Any) -> None:
    """Refuse an ``nn.TransformerEncoder`` that would take PyTorch's nested-tensor path.

    In eval mode without grad, given a ``src_key_padding_mask``, such an encoder
    runs on a nested tensor and returns zeros at the padded positions; a traced
    forward (Dynamo, so torch.compile too) takes the dense path, whose padded
    positions hold values. ``TransformerEncoderLayer``'s and
    ``MultiheadAttention``'s own fast paths trace to the same numbers.
    """
    owner = _owner(model)
    if owner is None or not torch.backends.mha.get_fastpath_enabled():
        return
    if torch.is_autocast_enabled():
        return
    for path, module in owner.named_modules():
        if not isinstance(module, torch.nn.TransformerEncoder):
            continue
        if not getattr(module, "use_nested_tensor", False) or module.layers[0].training:
            continue
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.layers[0].parameters()):
            continue  # eager takes the dense path, as the trace does
        name = f"model.{path}" if path else "model"
        raise CaptureError(
            f"{name} is an nn.TransformerEncoder built with enable_nested_tensor=True, in eval "
            "mode without grad: called with a src_key_padding_mask it takes PyTorch's "
            "nested-tensor fast path, which returns zeros at the padded positions, and a "
            "traced forward (Dynamo; torch.compile alike) does not reproduce that, so the "
            "artifact's padded positions would differ from eager's. Build it with "
            f"enable_nested_tensor=False, or set {name}.use_nested_tensor = False before "
            "capturing (the other positions are unchanged); to get zeros at padded positions, "
            "mask the output yourself (out.masked_fill(mask.unsqueeze(-1), 0))"
        )


def _user_line(message: str) -> str:
    hits = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', message)
    user = [h for h in hits if "/torch/" not in h[0]]
    if not user:
        return ""
    path, line, fn = user[-1]
    return f" (at {path}:{line}, in {fn})"


def _callable_name(model: Any) -> str:
    if isinstance(model, torch.nn.Module):
        return f"{type(model).__name__}.forward"
    return getattr(model, "__qualname__", type(model).__name__)


def dynamo(
    model: Any,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    dynamic: bool | None = None,
    size_oblivious: bool | None = None,
) -> DynamoOutput:
    """Capture ``model`` (an nn.Module or any callable) with Dynamo, as one graph.

    With ``dynamic=True`` Dynamo specialises sizes 0 and 1 (the artifact then
    serves sizes >= 2). ``size_oblivious=True`` keeps 0 and 1 inside the
    dynamic ranges (PyTorch's ``backed_size_oblivious``); it is turned on by
    itself when an example tensor is marked with
    ``torch._dynamo.mark_dynamic(t, dim, min=1, ...)``.
    """
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(
            f"example_kwargs must be a dict or None, got {type(example_kwargs).__name__}"
        )
    args = normalize_inputs(example_inputs)
    kwargs = dict(example_kwargs or {})
    refuse_nested_fast_path(model)
    log.info("dynamo: capturing %s", _callable_name(model))
    traceable, training = _traceable(model), _wants_grad(model, args, kwargs)
    one_rank = traced_on_one_rank(model)
    start = time.perf_counter()
    try:
        if size_oblivious is None:
            size_oblivious = _compat.wants_size_oblivious(args, kwargs)
        with one_rank_tracing(one_rank):  # DTensor models: rank-free code
            capture = _compat.fullgraph_capture(
                traceable, args, kwargs, dynamic, bool(size_oblivious)
            )
    except Exception as exc:
        if _compat.is_capture_error(exc):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            fix = _compat.capture_error_fix(exc) or (
                "Rewrite that line without the unsupported construct (see the message above), "
                "or move it out of forward()"
            )
            raise CaptureError(
                f"Dynamo could not capture the model as one graph: {first}{_user_line(str(exc))}. "
                f"{fix}."
            ) from exc
        if isinstance(exc, TypeError) and "argument" in str(exc):
            raise TypeError(f"example inputs do not match the model's signature: {exc}") from exc
        raise
    elapsed = time.perf_counter() - start
    log.info("dynamo: done in %.2f s (%d graph inputs)", elapsed, len(capture.input_sources))
    capture_id = uuid.uuid4().hex
    state = CaptureState(
        capture=capture,
        model=model,
        args=args,
        kwargs=kwargs,
        training=training,
        one_rank=one_rank,
        input_signature=describe_inputs(capture.signature, capture.bound_self, args, kwargs),
        capture_id=capture_id,
    )
    entries = capture_guards(
        capture.guards,
        capture.local_scope,
        _compat.shape_env_symbol_sources(capture),
        _compat.shape_env_guard_exprs(capture),
        _compat.global_state_snapshot(),
        root_is_module=isinstance(model, torch.nn.Module),
        symbol_all_sources=_compat.shape_env_symbol_all_sources(capture),
    )
    handoff = Handoff(
        "dynamo",
        state,
        Guards(entries, capture_id=capture_id),
        stage_timings({}, "dynamo", elapsed),
        state.training,
        convention=(len(capture.fake_inputs), count_outputs(capture.graph_module)),
    )
    return DynamoOutput(
        capture.graph_module,
        capture.graph_capture_output.bytecode,
        hand_out(handoff, capture.graph_module),
        handoff,
    )
