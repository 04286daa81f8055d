"""Every private PyTorch name the package touches, in one list, and its check.

``_compat/`` and ``lean/`` are the only code that reaches into PyTorch's
internals; this list names each thing they reach (a module, an attribute, a
class member) and the keyword parameters, dataclass fields or config keys used.
:func:`contract_check.problems` resolves every entry on the installed torch and
returns each one missing or changed, all at once: a new release is judged by one
report (``tests/test_torch_contract.py``), not by a user. A layout test keeps the list
complete (a ``torch._...`` name used there but absent here fails it). An entry:
``"module:attr.path"`` (``"module"`` alone); ``alternatives``: other places where
some supported torch keeps the same thing (any one resolving is enough); ``cuda``
entries: checked only on a CUDA build. Importing this imports nothing from torch.

Members count too: a class entry lists the members read off its objects
(``ShapeEnv._maybe_evaluate_static``), ``"a|b"`` where the code takes either.
Run-time attributes (``attrs``: a tensor's ``mark_dynamic`` marks) and Dynamo's
guard source grammar (``guards/_source.py``) are checked by a probe
(``contract_probes.py``) on a real object or a tiny capture; :data:`RECEIVERS`
names variables holding a private class's objects. The entries inside the
compilers (Dynamo, AOTAutograd, Inductor) are written in ``contract_compilers.py``,
the rest here; :data:`CONTRACT` holds both."""

from __future__ import annotations

from .contract_compilers import COMPILERS
from .contract_entry import PrivateName
from .contract_entry import entry as _n

__all__ = ["CONTRACT", "RECEIVERS", "PrivateName"]


CONTRACT: tuple[PrivateName, ...] = (
    # --- torch._C (the lean guards, the lean runtime, Inductor's wrapper) ---
    _n("torch._C:DispatchKey.Undefined"),
    _n("torch._C:DispatchKeySet", "raw_repr"),
    _n("torch._C:_DisableAutocast"),
    _n("torch._C:_StaticCudaLauncher._launch_kernel", cuda=True),
    _n("torch._C:_StaticCudaLauncher._load_kernel", cuda=True),
    _n("torch._C:_autograd._get_current_graph_task_keep_graph"),
    _n("torch._C:_autograd._top_saved_tensors_default_hooks"),
    _n("torch._C:_construct_storage_from_data_pointer"),
    _n("torch._C:_dispatch_keys"),
    _n("torch._C:_dispatch_tls_local_exclude_set"),
    _n("torch._C:_dispatch_tls_local_include_set"),
    _n("torch._C:_dynamo.guards.GlobalStateGuard", "check", "__setstate__"),
    _n(
        "torch._C:_dynamo.guards.TensorGuards",
        "check",
        "dynamic_dims_sizes",
        "dynamic_dims_strides",
        probe="TensorGuards(*tensors, dynamic_dims_sizes=, dynamic_dims_strides=)",
    ),
    _n("torch._C:_dynamo.guards.assert_size_stride"),
    _n("torch._C:_is_any_autocast_enabled"),
    _n("torch._C:_len_torch_function_stack"),
    _n("torch._C:_profiler._RecordFunctionFast"),
    _n("torch._C:_set_storage_data_ptr_access_error_msg", cuda=True),
    # --- small private helpers outside the compilers ---
    _n("torch.autograd.profiler:_is_profiler_enabled"),
    _n("torch.utils._device:CURRENT_DEVICE"),
    _n("torch.utils._pytree:tree_leaves"),
    _n("torch.utils._python_dispatch:TorchDispatchMode"),
    _n("torch._guards:CompileContext"),
    _n("torch._guards:Guard", "obj_weakref", "create_fn"),  # obj_weakref: see guard_manager
    _n("torch._guards:TracingContext.get"),
    _n("torch._guards:compile_context"),
    _n("torch._guards:tracing"),
    _n("torch._ops:OpOverloadPacket"),
    _n("torch._dispatch.python:enable_python_dispatcher"),
    _n("torch._decomp.decompositions_for_rng:PhiloxStateTracker"),
    _n("torch.fx.experimental._config", "backed_size_oblivious"),
    # Members of private classes, read off the objects private APIs return.
    _n(
        "torch.fx.experimental.symbolic_shapes:ShapeEnv",
        "optimization_hint|size_hint",  # inductor_fixes.optimization_hint: 2.12+ | 2.11
        "_maybe_evaluate_static",
        "var_to_range",
        "var_to_sources",
        "replacements",
        "guards",
    ),
    _n("torch.fx:Graph", "_tracer_cls", "_codegen"),  # graph_copy.py copies a graph
    _n("torch:Tensor", "_is_view"),
    _n("torch:UntypedStorage", "_cdata"),
    _n("torch._C:_FunctionBase", "_materialize_non_diff_grads"),  # lean/autograd.py
    # nn.Module internals: the hooks check (hooks.py), the stand-in (lean/standin/module.py).
    _n(
        "torch.nn:Module",
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_forward_pre_hooks",
        "_forward_hooks",
        "_backward_pre_hooks",
        "_backward_hooks",
        probe="nn.Module internals",
    ),
    _n("torch.nn.modules.module:_global_forward_pre_hooks"),
    _n("torch.nn.modules.module:_global_forward_hooks"),
    _n("torch.nn.modules.module:_global_backward_pre_hooks"),
    _n("torch.nn.modules.module:_global_backward_hooks"),
    _n(
        "torch.distributed.device_mesh:DeviceMesh",
        "_dim_group_names",
        "_flatten_rank_map",
        "_layout",
        "_thread_id",
    ),
    _n("torch.distributed._ops.device_mesh", after="torch.distributed.tensor"),
    _n("torch.distributed.tensor:DTensor", "_spec", "__new__", "_local_tensor", "_is_param"),
    _n(
        "torch.distributed.tensor._dtensor_spec:DTensorSpec",
        "tensor_meta",
        after="torch.distributed.tensor",
    ),
    _n("torch.distributed.tensor._dtensor_spec:TensorMeta", after="torch.distributed.tensor"),
    _n(
        "torch.compiler.config",
        "compile_on_one_rank",
        alternatives=("torch.distributed.config",),  # before torch 2.14
    ),
    # --- Dynamo, AOTAutograd, Inductor (contract_compilers.py) ---
    *COMPILERS,
)


# Variables that hold a private class's objects in _compat/: each member read off
# one must be a use of that class's entry (tests/test_torch_contract.py).
RECEIVERS = {
    "shape_env": "torch.fx.experimental.symbolic_shapes:ShapeEnv",
    "jd": "torch._functorch.aot_autograd:JointWithDescriptors",
}
