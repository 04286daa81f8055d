"""Dynamo: fullgraph capture and what its shape environment recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch

# Guard kinds PyTorch itself refuses to serialize (object identities of this process).
UNSERIALIZABLE_GUARD_KINDS = (
    "DICT_VERSION",
    "NN_MODULE",
    "ID_MATCH",
    "FUNCTION_MATCH",
    "CLASS_MATCH",
    "MODULE_MATCH",
    "CLOSURE_MATCH",
    "WEAKREF_ALIVE",
)


@dataclasses.dataclass
class Capture:
    """Everything Dynamo's fullgraph capture produced, kept for the later stages."""

    graph_capture_output: Any  # convert_frame.GraphCaptureOutput
    backend_id: str
    graph_module: torch.fx.GraphModule
    fake_inputs: list[Any]
    fake_mode: Any
    tensor_to_context: Any
    traced_fn: types.FunctionType
    bound_self: object | None
    signature: inspect.Signature
    device_type: str
    guards: list[Any]  # torch._guards.Guard
    local_scope: dict[str, Any]
    input_sources: list[str]
    size_oblivious: bool = False
    grad_enabled: bool = True  # grad mode at capture; the guards are built under it


# --------------------------------------------------------------------- dynamo


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import Unsupported, UserError

    return (Unsupported, UserError)


def wants_size_oblivious(args: Any, kwargs: Any) -> bool:
    """Whether an example tensor was marked dynamic with ``min`` 0 or 1.

    Dynamo specialises sizes 0 and 1 unless the ShapeEnv reasons about backed
    sizes "size-obliviously"; honouring ``mark_dynamic(t, d, min=1)`` needs it.
    """
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        for rng in getattr(leaf, "_dynamo_dynamic_range", ()) or ():
            if rng.min is not None and rng.min <= 1:
                return True
    return False


def mark_dynamic(tensor: torch.Tensor, dim: int, low: int | None, high: int | None) -> None:
    """``torch._dynamo.mark_dynamic``: ``tensor``'s ``dim`` is captured as a size in
    ``[low, high]`` (a missing bound is Dynamo's default)."""
    torch._dynamo.mark_dynamic(tensor, dim, min=low, max=high)


def mark_static_address(tensor: torch.Tensor) -> None:
    """``torch._dynamo.mark_static_address`` (no guard on the address): the compiled
    graph reads and writes ``tensor`` where it is. Under CUDA graphs an input that is
    not static is copied into the graph's own memory, so writes to it (a KV cache
    the step updates in place) would not reach the caller's tensor."""
    torch._dynamo.mark_static_address(tensor, guard=False)


def size_oblivious_context(enabled: bool) -> Any:
    """ShapeEnv setting that keeps 0 and 1 inside a dynamic size's range."""
    if not enabled:
        return contextlib.nullcontext()
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


@contextlib.contextmanager
def _capture_context(dynamic: bool | None) -> Iterator[None]:
    from torch._dynamo.eval_frame import set_enable_dynamic
    from torch._dynamo.utils import get_metrics_context
    from torch._dynamo.variables.torch_function import (
        torch_function_mode_stack_state_mgr,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(get_metrics_context())
        stack.enter_context(torch._functorch.config.patch(strict_autograd_cache=True))
        if dynamic is not None:
            stack.enter_context(set_enable_dynamic(dynamic))
        # Python floats (dropout p, LayerNorm eps) stay constants: symbolic floats
        # make AOTAutograd ask Dynamo to restart the trace, which a staged
        # pipeline cannot do once the capture is handed on.
        stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
        if dynamic is None:
            # Static unless marked: no "automatic dynamic" from earlier captures of
            # the same code in this process, so a capture does not depend on history.
            stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
        # A library's log call in forward (transformers' `logger.warning_once`) would
        # break the graph; the artifact does not log, as torch.compile's
        # `ignore_logging_functions` has it. Methods libraries add to Logger count too.
        stack.enter_context(
            torch._dynamo.config.patch(
                ignore_logging_functions=set(torch._dynamo.config.ignore_logging_functions)
                | _logger_methods()
            )
        )
        stack.enter_context(torch_function_mode_stack_state_mgr)
        yield


_LOG_METHODS = (
    "debug",
    "info",
    "warning",
    "warn",
    "error",
    "exception",
    "critical",
    "fatal",
    "log",
)


def _logger_methods() -> set[Any]:
    """``logging.Logger``'s emitting methods, and the ones libraries add to the class
    (transformers' ``warning_once``, an ``lru_cache`` wrapper): each returns None, as
    Dynamo requires."""
    standard = {getattr(logging.Logger, name) for name in _LOG_METHODS}
    added = {
        value
        for name, value in vars(logging.Logger).items()
        if callable(value)
        and not isinstance(value, type)
        and getattr(value, "__module__", "logging") != "logging"
        and not name.startswith("_")
    }
    return standard | added


@contextlib.contextmanager
def _half_open_marks(inputs: Any) -> Iterator[None]:
    """``mark_dynamic(t, dim, min=1)`` with no ``max`` (or a ``max`` with no ``min``)
    crashes Dynamo's capture (``not simple sympy type``): for the capture, the
    missing bound is Dynamo's own default (2, or no upper bound); the tensor's
    marks are as they were afterwards."""
    from torch._dynamo.decorators import _DimRange
    from torch.utils._sympy.numbers import int_oo

    saved = []
    for leaf in torch.utils._pytree.tree_leaves(inputs):
        ranges = (
            getattr(leaf, "_dynamo_dynamic_range", None) if isinstance(leaf, torch.Tensor) else None
        )
        if not ranges or all((r.min is None) == (r.max is None) for r in ranges):
            continue
        saved.append((leaf, ranges))
        leaf._dynamo_dynamic_range = {
            r
            if (r.min is None) == (r.max is None)
            else _DimRange(r.dim, 2 if r.min is None else r.min, int_oo if r.max is None else r.max)
            for r in ranges
        }
    try:
        yield
    finally:
        for leaf, ranges in saved:
            leaf._dynamo_dynamic_range = ranges


def fullgraph_capture(
    model: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic: bool | None,
    size_oblivious: bool = False,
) -> Capture:
    """Run Dynamo's fullgraph capture; raises Dynamo's own exceptions on failure."""
    from torch._dynamo import convert_frame

    with (
        _capture_context(dynamic),
        size_oblivious_context(size_oblivious),
        _half_open_marks((args, kwargs)),
    ):
        out = convert_frame.fullgraph_capture(model, args, kwargs)
    gco = out.graph_capture_output
    backend_input = out.backend_input
    if backend_input is None:
        raise ValueError("the model computes nothing with tensors, so there is no graph to compile")
    fn, bound_self = convert_frame.get_traced_fn(model)
    gm = backend_input.graph_module
    gm._backend_id = backend_input.backend_id  # type: ignore[assignment]
    og = gco.output_graph
    sources = [
        source.name
        for _, source in sorted(og.export_metadata.graph_input_idx_to_local_source.items())
    ]
    return Capture(
        graph_capture_output=gco,
        backend_id=backend_input.backend_id,
        graph_module=gm,
        fake_inputs=list(backend_input.example_inputs),
        fake_mode=backend_input.fake_mode,
        tensor_to_context=backend_input.tensor_to_context,
        traced_fn=fn,
        bound_self=bound_self,
        signature=convert_frame._get_signature(fn),
        device_type=_graph_device_type(gm.graph),
        guards=list(og.guards),
        local_scope=og.local_scope,
        input_sources=sources,
        size_oblivious=size_oblivious,
        grad_enabled=torch.is_grad_enabled(),
    )


def _graph_device_type(graph: Any) -> str:
    """The one device type PyTorch's AOT compile records for the graph (its load check)."""
    if FROM_2_15:  # every device the graph names, then collapsed to one (accelerator first)
        from torch._dynamo.graph_utils import _graph_device_types
        from torch._dynamo.package import _collapse_device_types

        return _collapse_device_types(_graph_device_types(graph))
    from torch._dynamo.graph_utils import _graph_device_type

    return _graph_device_type(graph)


def is_capture_error(exc: BaseException) -> bool:
    return isinstance(exc, _dynamo_errors())


# What torch 2.11 (the oldest of the range) does differently is keyed on this one
# flag (docs/limits.md lists each difference); 2.12 is untested and taken as 2.11.
BEFORE_2_13 = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)

# What torch 2.15 (the newest of the range) does differently is keyed on this one flag
# (docs/limits.md lists each difference).
FROM_2_15 = torch.torch_version.TorchVersion(torch.__version__) >= (2, 15)

# Dynamo inlines ``copy.deepcopy`` from torch 2.13; torch 2.11's raises ``Unsupported``
# on it. Transformers calls it in ``get_text_config`` of an encoder-decoder config
# with a flat structure (T5) when the forward builds its cache (``use_cache``).
TRACES_DEEPCOPY = not BEFORE_2_13


def capture_error_fix(exc: BaseException) -> str | None:
    """How to avoid a capture error this torch's Dynamo raises where a newer one
    traces the code (None: no known fix beyond rewriting the line)."""
    if not TRACES_DEEPCOPY and "copy.deepcopy()" in str(exc):
        return (
            f"torch {torch.__version__}'s Dynamo cannot trace copy.deepcopy (torch 2.13 "
            "can); transformers calls it when an encoder-decoder model (T5) builds its "
            "cache in forward: pass use_cache=False, or use torch >= 2.13"
        )
    return None


def shape_env_guard_exprs(capture: Capture) -> list[str]:
    """The symbolic-shape guards recorded so far, as readable expressions."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return []
    return [str(g.expr) for g in shape_env.guards]


def shape_env_var_ranges(capture: Capture) -> dict[str, tuple[int, int | None]]:
    """Value ranges of the symbols of the capture (for dynamic-shape messages)."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return {}
    out = {}
    ranges = shape_env.var_to_range
    for sym, vr in ranges.items():
        # A symbol found equal to another (s18 == s72) keeps a stale range of
        # its own; what holds is the range of what it was replaced by.
        rep = shape_env.replacements.get(sym)
        if rep is not None and rep in ranges:
            vr = ranges[rep]
        elif rep is not None and getattr(rep, "is_number", False):
            out[str(sym)] = (int(rep), int(rep))
            continue
        out[str(sym)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    return out


def _bound(value: Any) -> int | None:
    """A finite sympy bound as int; None for (int_)oo."""
    try:
        return int(value) if bool(value.is_finite) else None
    except (TypeError, AttributeError, ValueError):
        return None


def shape_env_symbol_sources(capture: Capture) -> dict[str, str]:
    """Map each shape symbol (``s0``) to the first input dimension it stands for."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return {}
    return {
        str(sym): sources[0].name for sym, sources in shape_env.var_to_sources.items() if sources
    }


def shape_env_symbol_all_sources(capture: Capture) -> dict[str, list[str]]:
    """Map each shape symbol (``s0``) to every input dimension that has its size."""
    shape_env = capture.fake_mode.shape_env
    if shape_env is None:
        return {}
    return {
        str(sym): [s.name for s in sources]
        for sym, sources in shape_env.var_to_sources.items()
        if sources
    }
