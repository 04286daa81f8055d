"""Dynamo's guards of a capture: the save-time filter's entries and the guard manager."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..lean import hook_guards_enabled
from ..lean.guard_schema import GuardTree
from ..lean.pickling import findable_by_name, function_by_value, reducer_override_patched
from ..lean.standin.config import dict_base, is_config, reduce_dict_config
from .capture import Capture


@contextlib.contextmanager
def _guard_state_pickled_portably() -> Iterator[None]:
    """Pickle Dynamo's guard state so that it rebuilds in a process without the model.

    - nn.Modules become plain ``nn.Module`` objects: PyTorch pickles a
      module-level class by reference, so loading would need the model's class
      to be importable. Guards on module *types* are dropped by our filter, so
      a plain module with the same attributes rebuilds the same guard tree.
      Its state is ``nn.Module``'s (the instance ``__dict__``), whatever
      ``__getstate__`` its class defines: the guards read the instance's
      attributes, as on the stand-in, and a class's own pickling rules are for
      pickling the model (a module with a parametrization, such as
      ``weight_norm``, refuses to be pickled at all).
    - A config that is a dict (diffusers' ``FrozenDict``) rebuilds as its real
      class, or as its stand-in when loaded for saved weights (see
      :mod:`torch_precompile.lean.standin.config`): Dynamo checks a dict's exact type.
    - A function pickle cannot find by qualified name (the undecorated
      function a ``functools.wraps`` decorator keeps in its closure) is saved
      by value. PyTorch would save a ``_Missing`` placeholder, and the guards
      kept on it (its ``__defaults__``, say) would fail at load.
    """
    from torch._dynamo.guards import GuardsStatePickler

    original = GuardsStatePickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if (
            isinstance(obj, torch.nn.Module)
            and type(obj) is not torch.nn.Module
            and id(obj) in self.guard_tree_values
            and not isinstance(obj, torch.nn.parallel.DistributedDataParallel)
        ):
            original(self, obj)  # records missing values as a side effect
            return GuardsStatePickler._unpickle_module, (torch.nn.Module.__getstate__(obj),)
        dict_config = isinstance(obj, dict) and type(obj) is not dict and is_config(obj)
        if dict_config and dict_base(type(obj)) is not None:
            return reduce_dict_config(obj)
        if (
            inspect.isfunction(obj)
            and id(obj) not in self.missing_values
            and "<locals>" not in obj.__qualname__
            and not findable_by_name(obj)
        ):
            return function_by_value(obj)
        return original(self, obj)

    with reducer_override_patched(GuardsStatePickler, reducer_override):
        yield


def guard_filter_entry_fields(entry: Any) -> tuple[str, str, bool, Any]:
    """(name, guard_type, is_global, value) of a Dynamo GuardFilterEntry.

    ``is_global``: the source is rooted in the capturing process's globals, as
    Dynamo's own flag says, or in a module it reached by import, which Dynamo's
    flag leaves out (see :func:`_rooted_in_process_globals`).
    """
    orig = getattr(entry, "orig_guard", None)
    source = getattr(orig, "originating_source", None)
    is_global = entry.is_global or (source is not None and _rooted_in_process_globals(source))
    return entry.name, entry.guard_type, is_global, entry.value


def _rooted_in_process_globals(source: Any) -> bool:
    """Whether a Dynamo source reads the process's state rather than the call's inputs:
    a global of the traced code's module, or a module Dynamo imports itself
    (``__import__('torch').utils._pytree.SUPPORTED_NODES``, a registry that
    libraries fill as they are imported, guarded when traced code uses pytree).

    Dynamo rebuilds an import-rooted source only inside a trace, so such a
    source in the saved guard state would also fail to load.
    """
    from torch._dynamo.source import ChainedSource, ImportSource, get_global_source_name

    if get_global_source_name(source) is not None:
        return True
    while isinstance(source, ChainedSource):
        source = source.base
    return isinstance(source, ImportSource)


def guard_filter_entry_derived_kinds(entry: Any) -> tuple[str, ...]:
    """The guard kinds a Dynamo GuardFilterEntry is built on (BUILTIN_MATCH -> ID_MATCH)."""
    return tuple(getattr(entry, "derived_guard_types", ()) or ())


def guard_filter_entry_hasattr_name(entry: Any) -> str | None:
    """The attribute a HASATTR GuardFilterEntry asks about (its ``name`` is the object's)."""
    create_fn = getattr(getattr(entry, "orig_guard", None), "create_fn", None)
    keywords = getattr(create_fn, "keywords", None) or {}
    attr = keywords.get("attr")
    return attr if isinstance(attr, str) else None


# The capture's frame locals while Dynamo's guard filter runs (see hasattr_owner).
_FRAME_LOCALS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "torch_precompile_frame_locals", default=None
)


def hasattr_owner(entry: Any) -> tuple[str, Any] | None:
    """``(attribute, object)`` a torch 2.11 HASATTR GuardFilterEntry asks about: its
    source is the attribute (``L['self']._keep_in_fp32_modules``) and its value the
    attribute's, so the object is read off the capture's frame locals along the
    source's chain (plain attributes from a local). None if it cannot be."""
    locals_ = _FRAME_LOCALS.get()
    source = getattr(getattr(entry, "orig_guard", None), "originating_source", None)
    attr = getattr(source, "member", None)
    if locals_ is None or not isinstance(attr, str):
        return None
    chain = []
    source = getattr(source, "base", None)
    while getattr(source, "base", None) is not None:
        chain.append(source)
        source = source.base
    local = getattr(source, "local_name", None)
    if local not in locals_:
        return None
    value = locals_[local]
    for step in reversed(chain):
        if step.name == step.base.name:  # a wrapper naming its base (NNModuleSource)
            continue
        member = getattr(step, "member", None)
        if not isinstance(member, str) or step.name != f"{step.base.name}.{member}":
            return None
        value = getattr(value, member)
    return attr, value


def guard_filter_entry_source(entry: Any) -> str:
    """The full source of a GuardFilterEntry (``L['x']``; its ``name`` drops the ``L[...]``)."""
    orig = getattr(entry, "orig_guard", None)
    return getattr(orig, "name", None) or entry.name


def _pruning_key_order_sources(
    output_graph: Any,
    guard_filter: Callable[[Sequence[Any]], Sequence[bool]],
    keep_source: Callable[[str, bool], bool],
    kept: list[Any],
    frame_locals: dict[str, Any],
) -> Callable[[Sequence[Any]], list[bool]]:
    """Wrap ``guard_filter`` so that dict key order is guarded only where guards are kept
    (and the filter can read the capture's ``frame_locals``, :func:`hasattr_owner`).

    Dynamo evaluates every ``guard_on_key_order`` source each time it builds a
    guard manager, and again at load. The key order of a library's global
    registry (filled as its models are built) differs in another process, and
    the guards on it are dropped by our filter: evaluating its source at load
    would fail on something the artifact does not check. Dynamo calls the
    filter between its unfiltered and its filtered build; from then on (the
    in-process manager and the saved state alike) only sources that
    ``keep_source`` accepts and some kept guard reads are key-order guarded.
    The kept Guard objects are appended to ``kept``.
    """

    def wrapped(entries: Sequence[Any]) -> list[bool]:
        # The filtered build records each guarded object again. An object that a
        # property makes anew on each read (transformers' config.per_layer_config
        # view) is then another one than the first build's, still alive: torch 2.11
        # asserts they are identical. The second build records its own.
        for e in entries:
            e.orig_guard.obj_weakref = None
        token = _FRAME_LOCALS.set(frame_locals)
        try:
            keep = list(guard_filter(entries))
        finally:
            _FRAME_LOCALS.reset(token)
        kept[:] = [e.orig_guard for e, k in zip(entries, keep) if k]
        kept_names = [guard_filter_entry_source(e) for e, k in zip(entries, keep) if k]
        output_graph.guard_on_key_order = {
            source
            for source in output_graph.guard_on_key_order
            if keep_source(source.name, _rooted_in_process_globals(source))
            and any(source.name in name for name in kept_names)
        }
        return keep

    return wrapped


def build_guard_manager(
    capture: Capture,
    guard_filter: Callable[[Sequence[Any]], Sequence[bool]],
    keep_source: Callable[[str, bool], bool],
    read_tree: Callable[[Sequence[Any], Any, Any, dict[str, Any]], GuardTree | None] | None = None,
) -> tuple[Any, bytes, GuardTree | None]:
    """Build Dynamo's guard manager after compilation (so shape guards added by
    AOTAutograd and Inductor are included), its serialized state, and its tree
    read as the lean check's spec by ``read_tree(kept guards, check_fn,
    output_graph, frame locals)`` (None if it cannot be, or no reader is given):
    the artifact holds the spec until save writes it.

    ``keep_source(name, is_global)`` says whether guards on a source are saved;
    sources Dynamo evaluates for dict key order are pruned with it.
    """
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._dynamo.variables.torch_function import (
        torch_function_mode_stack_state_mgr,
    )

    output_graph = capture.graph_capture_output.output_graph
    key_order = output_graph.guard_on_key_order
    kept: list[Any] = []
    hooks = Hooks(
        guard_filter_fn=_pruning_key_order_sources(
            output_graph, guard_filter, keep_source, kept, capture.local_scope
        )
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_metrics_context())
        stack.enter_context(dynamo_timed("torch_precompile.build_guards"))
        if torch_function_mode_stack_state_mgr.stack:
            stack.enter_context(torch_function_mode_stack_state_mgr.temp_restore_stack())
        stack.enter_context(_guard_state_pickled_portably())
        stack.enter_context(hook_guards_enabled())
        # Dynamo checks the new guards against the current global state: restore the
        # capture's grad mode, so precompile() may run outside the capture's no_grad block.
        stack.enter_context(torch.set_grad_enabled(capture.grad_enabled))
        # A stage output is a value: the capture's key-order set is put back.
        stack.callback(setattr, output_graph, "guard_on_key_order", key_order)
        check_fn = capture.graph_capture_output.build_guards(
            capture.traced_fn.__code__, hooks=hooks, save=True, strict_error=True
        )
        # Read under the state the tree was built in (a tensor's dispatch keys).
        spec = None
        if read_tree is not None:
            spec = read_tree(kept, check_fn, output_graph, capture.local_scope)
    if check_fn.guards_state is None:
        raise RuntimeError("Dynamo produced no serializable guard state")
    return check_fn.guard_manager, check_fn.guards_state, spec
