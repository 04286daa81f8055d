"""Copies of AOTAutograd's graphs and exported joint: a graph module with its own
graph, an ATen graph with its repeated computations once, and a private copy of
the exported joint for each compile (which writes to what it is given)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module with its own graph (nodes, code), sharing attributes and node values.

    Node ``meta`` dicts are copied one level deep (fake tensors are shared, as
    FX's own ``graph_copy`` does); the module's ``meta`` likewise.
    """
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    # The code generator is shared, not deep-copied (its tree specs are immutable).
    graph._codegen = gm.graph._codegen
    if output is not None:
        value, old_output = output
        new_output = graph.output(value, type_expr=getattr(old_output, "type", None))
        new_output.meta = copy.copy(old_output.meta)
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    return new


def without_duplicates(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of an ATen graph whose repeated pure computations are computed once.

    AOTAutograd's own common-subexpression pass (which its partitioner runs on
    training graphs; an inference graph goes to Inductor without it): random
    operators, mutations and what aliases an output are kept as they are. The
    inputs and outputs are unchanged.
    """
    from torch._functorch.compile_utils import fx_graph_cse

    graph = fx_graph_cse(gm.graph)
    graph._codegen = gm.graph._codegen
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    return new


def _fresh(obj: Any, memo: dict[int, Any]) -> Any:
    """Copy the containers and dataclasses under ``obj``; share everything else.

    What AOTAutograd's compile mutates in its metadata (``make_runtime_safe``
    sets ``traced_tangent_metas`` and clears ``traced_tangents``; the
    partitioner records saved-tensor counts) are fields of mutable dataclasses
    and lists; tensors, symbolic sizes, frozen dataclasses (tree specs, alias
    infos) and the fake mode are shared, unchanged.
    """
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, list):
        new_list: list[Any] = []
        memo[key] = new_list
        new_list.extend(_fresh(v, memo) for v in obj)
        return new_list
    if isinstance(obj, tuple) and type(obj) is tuple:
        new_tuple = tuple(_fresh(v, memo) for v in obj)
        memo[key] = new_tuple
        return new_tuple
    if type(obj) is dict:
        new_dict: dict[Any, Any] = {}
        memo[key] = new_dict
        new_dict.update((k, _fresh(v, memo)) for k, v in obj.items())
        return new_dict
    if (
        dataclasses.is_dataclass(obj)
        and not isinstance(obj, type)
        and not obj.__dataclass_params__.frozen  # type: ignore[attr-defined]
        and hasattr(obj, "__dict__")
    ):
        new = copy.copy(obj)
        memo[key] = new
        for name, value in vars(obj).items():
            object.__setattr__(new, name, _fresh(value, memo))
        return new
    return obj


def joint_for_one_compile(jd: Any, gm: torch.fx.GraphModule) -> Any:
    """A private copy of the exported joint for one compile, compiling ``gm``.

    ``aot_compile_joint_with_descriptors`` writes to what it is given: the
    graph (Inductor's passes), the view/mutation metadata (made "runtime
    safe", which may happen once), the wrappers and the AOT config. Each
    compile gets its own copies, so the exported joint can compile again.
    """
    memo: dict[int, Any] = {}
    state = copy.copy(jd._aot_state)
    state.fw_metadata = _fresh(state.fw_metadata, memo)
    graph_capture = copy.copy(jd._aot_graph_capture)
    graph_capture.graph_module = copy_graph_module(gm)
    graph_capture.maybe_subclass_meta = _fresh(graph_capture.maybe_subclass_meta, memo)
    graph_capture.wrappers = _fresh(graph_capture.wrappers, memo)
    new = copy.copy(jd)
    new._aot_state = state
    new._aot_graph_capture = graph_capture
    return new
