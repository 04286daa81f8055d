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
names variables holding a private class's objects."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One private name of PyTorch that ``_compat/`` uses."""

    name: str
    uses: tuple[str, ...] = ()  # keyword parameters, fields, members or config keys
    alternatives: tuple[str, ...] = ()
    cuda: bool = False
    after: str = ""  # a module that must be imported first (as the package's code path does)
    since: str = ""  # the first torch that has it (checked from there on)
    probe: str = ""  # a check run on a real object (a C++ signature, a run-time attribute)
    attrs: tuple[str, ...] = ()  # private attributes set at run time: checked by the probe
    until: str = ""  # the first torch that no longer has it (checked before that one)

    def places(self) -> tuple[str, ...]:
        return (self.name, *self.alternatives)


def _n(name: str, *uses: str, **options: Any) -> PrivateName:
    """An entry: its name, its uses, then any of the other fields by keyword."""
    return PrivateName(name, tuple(uses), **options)


_DYN, _FT, _IND = "torch._dynamo", "torch._functorch", "torch._inductor"
_SCHEMAS = f"{_FT}._aot_autograd.schemas"

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
    _n("torch.fx:Graph", "_tracer_cls", "_codegen"),  # joint.py copies a graph
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
    # --- Dynamo: capture, guards, the AOTCompiledFunction format ---
    _n(
        f"{_DYN}:mark_dynamic",
        "min",
        "max",
        probe="mark_dynamic's marks",  # torch-precompile build --dynamic
        attrs=("_dynamo_dynamic_indices", "_dynamo_dynamic_range"),
    ),
    _n(f"{_DYN}:mark_static_address", "guard"),  # a generator's KV cache, read in place
    _n(f"{_DYN}.decorators:_DimRange"),  # mark_dynamic's range, built for a min without max
    _n("torch.utils._sympy.numbers:int_oo"),
    _n(
        f"{_DYN}.config",
        "automatic_dynamic_shapes",
        "ignore_logging_functions",
        "skip_nnmodule_hook_guards",
        "specialize_float",
    ),
    _n(f"{_DYN}.compiled_autograd:_disable"),
    _n(f"{_DYN}.convert_frame:_get_signature"),
    _n(f"{_DYN}.convert_frame:fullgraph_capture", probe="guard source strings"),
    _n(f"{_DYN}.convert_frame:get_compile_id"),
    _n(f"{_DYN}.convert_frame:get_traced_fn"),
    _n(f"{_DYN}.aot_compile:AOTCompilePickler.reducer_override"),
    _n(f"{_DYN}.aot_compile:AOTCompiledFunction", "_artifacts", "_extra_globals"),
    _n(
        f"{_FT}.aot_autograd:JointWithDescriptors",
        "_aot_state",
        "_aot_graph_capture",
        "graph_module",
    ),
    _n(f"{_DYN}.aot_compile:AOTCompiledFunction.deserialize", "f_globals"),
    _n(f"{_DYN}.aot_compile:AOTCompiledFunction.serialize"),
    _n(
        f"{_DYN}.aot_compile:CompileArtifacts",
        "signature",
        "guard_manager",
        "guards_state",
        "backend_id",
        "compiled_fn",
        "original_code",
        "runtime_env",
        "source_info",
        "device_type",
        "backend_name",
    ),
    _n(f"{_DYN}.aot_compile:bind_locals"),
    # capture.py names the graph module's backend as Dynamo's own capture does.
    _n(f"{_DYN}.aot_compile", probe="gm._backend_id", attrs=("_backend_id",)),
    _n(f"{_DYN}.aot_compile_types:BundledAOTAutogradSerializableCallable", "compiled_fn"),
    _n(f"{_DYN}.eval_frame:set_enable_dynamic"),
    _n(f"{_DYN}.exc:Unsupported"),
    _n(f"{_DYN}.exc:UserError"),
    # The device type a capture records: one scan before torch 2.15; from 2.15 the set of
    # devices the graph names, collapsed to one (capture._graph_device_type).
    _n(f"{_DYN}.graph_utils:_graph_device_type", until="2.15"),
    _n(f"{_DYN}.graph_utils:_graph_device_types", since="2.15"),
    _n(f"{_DYN}.package:_collapse_device_types", since="2.15"),
    _n(f"{_DYN}.guards:GuardManagerWrapper", "no_tensor_aliasing_sources"),  # 2.15: sources
    _n(f"{_DYN}.guards:GuardsStatePickler._unpickle_module"),
    _n(f"{_DYN}.guards:GuardsStatePickler.reducer_override"),
    _n(f"{_DYN}.hooks:Hooks", "guard_filter_fn"),
    _n(f"{_DYN}.types:GuardFilterEntry", "name", "guard_type", "is_global", "orig_guard"),
    _n(f"{_DYN}.mutation_guard:GenerationTracker.generation"),
    _n(f"{_DYN}.package:SourceInfo", "inlined_sources"),
    _n(f"{_DYN}.package:load_guard_manager"),
    _n(f"{_DYN}.package:load_guards_state"),
    _n(f"{_DYN}.source:ChainedSource", "base"),
    # The lean guards' reading of Dynamo's typed sources and guards state
    _n(f"{_DYN}.source:AttrSource", "member"),
    _n(f"{_DYN}.source:DefaultsSource", "idx_key"),
    _n(f"{_DYN}.source:DictGetItemSource", "index"),
    _n(f"{_DYN}.source:GenericAttrSource", "member"),
    _n(f"{_DYN}.source:GetItemSource", "index", "index_is_slice"),
    _n(f"{_DYN}.source:LocalSource", "local_name"),
    _n(f"{_DYN}.source:NNModuleSource"),
    _n(f"{_DYN}.guards:ShapeCodeParts", "python_code_parts"),
    _n(
        f"{_DYN}.output_graph:OutputGraphGuardsState",
        "input_source_to_sizes_strides",
        "torch_function_mode_stack",
        "current_device",
    ),
    _n(f"{_DYN}.source:ImportSource"),
    _n(f"{_DYN}.source:get_global_source_name"),
    _n(f"{_DYN}.utils:_disable_saved_tensors_hooks_during_tracing"),
    _n(f"{_DYN}.utils:dynamo_timed"),
    _n(f"{_DYN}.utils:get_metrics_context"),
    _n(
        f"{_DYN}.variables.torch_function:torch_function_mode_stack_state_mgr",
        "stack",
        "temp_restore_stack",
    ),
    # --- AOTAutograd: joint export and compile, its runtime metadata ---
    _n(
        f"{_FT}.config",
        "strict_autograd_cache",
        "bypass_autograd_cache_key",
        "bundled_autograd_cache",
        "force_non_lazy_backward_lowering",
        "force_autograd_cache",
        "unlift_effect_tokens",
    ),
    _n(
        f"{_FT}.aot_autograd:aot_export_joint_with_descriptors",
        "decompositions",
        "keep_inference_input_mutations",
    ),
    _n(
        f"{_FT}.aot_autograd:aot_compile_joint_with_descriptors",
        "partition_fn",
        "fw_compiler",
        "bw_compiler",
        "serializable",
    ),
    _n(f"{_FT}.aot_autograd:preserve_rng_state"),
    _n(f"{_FT}.compile_utils:fx_graph_cse"),
    # lean/inference.py marks inputs as AOTAutograd's runtime wrapper does.
    _n(
        f"{_FT}._aot_autograd.runtime_wrappers",
        probe="t._dynamo_propagated_dynamic_indices",
        attrs=("_dynamo_propagated_dynamic_indices",),
        since="2.13",  # torch 2.11 marks nothing (the mark is then unread, and harmless)
    ),
    _n(f"{_FT}._aot_autograd.runtime_wrappers:SerializableCompiledFunction", "serialize"),
    _n(
        f"{_FT}._aot_autograd.aot_autograd_result:GenericAOTAutogradResult",
        "compiled_fw",
        "compiled_bw",
        "runtime_metadata",
        "dispatch_wrappers",
        "maybe_subclass_meta",
        "num_fw_outs_saved_for_bw",
        "indices_of_inps_to_detach",
    ),
    _n(f"{_SCHEMAS}:MutationType.MUTATED_OUT_GRAPH"),
    _n(f"{_SCHEMAS}:OutputType.alias_of_input"),
    _n(f"{_SCHEMAS}:OutputType.is_input"),
    _n(f"{_SCHEMAS}:OutputType.non_alias"),
    _n(f"{_SCHEMAS}:OutputType.unsafe_view_alias"),
    _n(
        f"{_SCHEMAS}:ViewAndMutationMeta",
        "input_info",
        "output_info",
        "tokens",
        "num_intermediate_bases",
        "num_outputs",
        "num_forward_returns",
        "num_backward_tokens",
        "num_graphsafe_rng_states",
        "is_rng_op_functionalized",
        "grad_enabled_mutation",
        "deterministic",
        "bw_donated_idxs",
        "subclass_tangent_meta",
        "dynamic_saved_tensors_idxs",
        "unsafe_view_out_indices",
        "mutated_graph_handled_indices_seen_by_autograd",
        "indices_of_inputs_that_requires_grad_with_mutations_in_bw",
        "tensors_saved_for_backwards_with_vc_check_slice",
        "tensors_saved_for_backwards_no_vc_check_slice",
        "symints_saved_for_backwards_slice",
        "opaque_objects_saved_for_backwards_slice",
        "subclass_inp_meta",  # DTensor inputs fed as local shards (lean.subclasses)
        "subclass_fw_graph_out_meta",
    ),
    _n(f"{_SCHEMAS}:PlainTensorMeta", "unwrapped_idx"),
    _n(f"{_SCHEMAS}:OpaqueMeta", since="2.13"),
    _n(
        f"{_SCHEMAS}:SubclassCreationMeta",
        "flat_tensor_start_idx",
        "attrs",
        "outer_size",
        "outer_stride",
        "meta",
        "original_subclass_type",
    ),
    _n(
        f"{_SCHEMAS}:OutputAliasInfo",
        "output_type",
        "raw_type",
        "base_idx",
        "dynamic_dims",
        "requires_grad",
    ),
    _n(
        f"{_SCHEMAS}:InputAliasInfo",
        "mutation_type",
        "mutates_storage_metadata",
        "mutation_inductor_storage_resize",
        "requires_grad",
    ),
    # --- Inductor: compile, its generated wrapper, shipped kernels ---
    _n(
        f"{_IND}.config",
        "triton.cudagraphs",
        "triton.descriptive_names",
        "strict_static_triton_launcher",
    ),
    _n(f"{_IND}.config:cpp.dynamic_threads"),  # a generator's kernels read the thread count
    _n(f"{_IND}:list_mode_options"),
    _n(f"{_IND}.compile_fx:compile_fx_backward", "compiler_config_extra"),
    _n(
        f"{_IND}.compile_fx:compile_fx_forward",
        "num_orig_model_outputs",
        "num_example_inputs",
        "compiler_config_extra",
        "is_inference",
    ),
    _n(f"{_IND}.compile_fx:create_compiler_config_extra"),
    _n(f"{_IND}.compile_fx:get_num_model_outputs"),
    _n(f"{_IND}.compile_fx:partition_fn"),
    _n(f"{_IND}.compile_fx:run_pre_grad_passes"),
    _n(f"{_IND}.decomposition:select_decomp_table"),
    _n(f"{_IND}.inductor_prims:force_stride_order"),
    _n(f"{_IND}.virtualized:V.set_fake_mode"),
    _n(f"{_IND}.codegen.cpp:CppKernel", "check_bounds", "rename_indexing", "sexpr"),  # 2.11
    _n(f"{_IND}.codegen.common:Kernel", "loads", "compute", "cse"),
    _n(f"{_IND}.codegen.common:CSE", "try_get"),
    _n(f"{_IND}.ir:argsort_sym"),  # joint.py patches both places
    _n(f"{_IND}.utils:argsort_sym"),
    _n(
        f"{_IND}.output_code:CompiledFxGraph",
        "source_code",
        "cudagraph_info",
        "partition_maps",
        "device_idxs",
        "device_types",
        "fx_kwargs",
        "constants",
        "torchbind_constants",
    ),
    _n(f"{_IND}.output_code:CompiledFxGraphConstants"),
    _n(f"{_IND}.output_code:CompiledFxGraphConstantsWithGm"),
    _n(f"{_IND}.codecache:CppPythonBindingsCodeCache.load_pybinding"),
    _n(f"{_IND}.codecache:CppPythonBindingsCodeCache.load_pybinding_async"),
    _n(f"{_IND}.codecache:PyCodeCache.load"),
    _n(f"{_IND}.cpp_builder:CppBuilder.build"),
    _n(f"{_IND}.cpu_vec_isa:valid_vec_isa_list.cache_info"),
    _n(f"{_IND}.cpu_vec_isa:pick_vec_isa"),
    _n(f"{_IND}.exc:InvalidCxxCompiler"),
    _n(f"{_IND}.select_algorithm:extern_kernels"),
    _n(f"{_IND}.runtime.cache_dir_utils:triton_cache_dir"),
    _n(f"{_IND}.runtime.runtime_utils:triton_hash_to_path_key"),
    _n(f"{_IND}.runtime.triton_heuristics:StaticTritonCompileResult.can_statically_launch"),
    _n(
        f"{_IND}.runtime.triton_heuristics:CachingAutotuner",
        "launchers",
        "inductor_meta",
        probe="launcher._is_static",  # lean/triton_kernels.py ships only static launchers
        attrs=("_is_static",),
    ),
    _n("torch._C:_dynamo.guards._torchinductor_pyobject_tensor_data_ptr"),
    # Names Inductor's generated wrapper imports (stood in for at a lean load).
    _n(f"{_IND}.hooks:run_intermediate_hooks"),
    _n(f"{_IND}.utils:maybe_profile"),
    _n(f"{_IND}.codegen.memory_planning:_align"),
    _n(f"{_IND}.async_compile:AsyncCompile", "cpp_pybinding", "triton", "wait"),
    _n(f"{_IND}.runtime.triton_heuristics:start_graph"),
    _n(f"{_IND}.runtime.triton_heuristics:end_graph"),
    _n(f"{_IND}.runtime.runtime_utils:assert_tensor_metadata", since="2.14"),
)


# Variables that hold a private class's objects in _compat/: each member read off
# one must be a use of that class's entry (tests/test_torch_contract.py).
RECEIVERS = {
    "shape_env": "torch.fx.experimental.symbolic_shapes:ShapeEnv",
    "jd": "torch._functorch.aot_autograd:JointWithDescriptors",
}
