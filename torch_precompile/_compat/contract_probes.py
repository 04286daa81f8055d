"""The checks of :mod:`contract` that run something: a C++ callable's keyword
parameters and the attributes torch sets at run time cannot be read off a class,
so each entry with a ``probe`` names one of these, run on the installed torch.
Importing this module imports nothing from PyTorch.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def _tensor_guards_probe(tensor_guards: type) -> None:
    import torch

    t = torch.zeros(2, 3)
    guards = tensor_guards(t, dynamic_dims_sizes=[[2, 3]], dynamic_dims_strides=[[3, 1]])
    if not guards.check(t) or guards.check(torch.zeros(3, 2)):
        raise RuntimeError("TensorGuards no longer checks sizes as given")


def _module_internals_probe(module_cls: type) -> None:
    """The dicts lean/standin/module.py and hooks.py read off a module hold what they say."""
    import torch

    lin = torch.nn.Linear(2, 2)
    lin.register_buffer("kept", torch.zeros(1))
    lin.register_buffer("dropped", torch.zeros(1), persistent=False)
    lin.add_module("child", torch.nn.Identity())
    lin.register_forward_hook(lambda *a: None)
    checks = {
        "_parameters": set(lin._parameters) == {"weight", "bias"},
        "_buffers": set(lin._buffers) == {"kept", "dropped"},
        "_non_persistent_buffers_set": set(lin._non_persistent_buffers_set) == {"dropped"},
        "_modules": set(lin._modules) == {"child"},
        "_forward_hooks": len(lin._forward_hooks) == 1 and not lin._forward_pre_hooks,
        "_backward_hooks": not lin._backward_hooks and not lin._backward_pre_hooks,
    }
    wrong = [name for name, ok in checks.items() if not ok or not isinstance(lin, module_cls)]
    if wrong:
        raise RuntimeError(f"nn.Module's {', '.join(wrong)} no longer hold(s) what they did")


def _mark_dynamic_probe(mark_dynamic: Any) -> None:
    """The marks capture.py and lean_writer/guard_leaves.py read off a marked tensor."""
    import torch

    t = torch.zeros(4, 3)
    mark_dynamic(t, 0, min=2, max=9)
    if getattr(t, "_dynamo_dynamic_indices", None) != {0}:
        raise RuntimeError("a marked tensor has no _dynamo_dynamic_indices {0}")
    if not getattr(t, "_dynamo_dynamic_range", None):
        raise RuntimeError("a marked tensor has no _dynamo_dynamic_range")


def _mentions(module: str, text: str) -> Any:
    """A probe of an attribute torch sets or reads at run time on objects no small
    check can build (a CUDA launcher, an input at a compiled call): torch's own
    source still writes it so."""

    def probe(_obj: Any) -> None:
        if text not in inspect.getsource(importlib.import_module(module)):
            raise RuntimeError(f"{module} no longer has {text!r}")

    return probe


# Keyword parameters of C++ callables and attributes set at run time cannot be read
# off a class: these checks are run instead.
# Probes of code above this layer register themselves (register_probe): the source
# grammar's, by guards/_source.py, which owns it.
PROBES = {
    "TensorGuards(*tensors, dynamic_dims_sizes=, dynamic_dims_strides=)": _tensor_guards_probe,
    "nn.Module internals": _module_internals_probe,
    "mark_dynamic's marks": _mark_dynamic_probe,
    "launcher._is_static": _mentions(
        "torch._inductor.runtime.triton_heuristics", "._is_static = True"
    ),
    "gm._backend_id": _mentions("torch._dynamo.aot_compile", "._backend_id"),
    "t._dynamo_propagated_dynamic_indices": _mentions(
        "torch._functorch._aot_autograd.runtime_wrappers", "_dynamo_propagated_dynamic_indices"
    ),
}


def register_probe(name: str, probe: Any) -> None:
    """Add the probe ``name`` of a contract entry, written where what it checks lives."""
    PROBES[name] = probe
