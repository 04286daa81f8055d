"""The save-time adapters over PyTorch's private compiler APIs.

Every call into ``torch._dynamo``, ``torch._functorch``, ``torch._inductor``
and ``torch._C`` internals at capture, compile and save, and all knowledge of
the code Inductor generates, lives in this package, so that a PyTorch upgrade
is this folder's work (and ``lean/``'s, for the runtime side). The rest of
``torch_precompile`` uses only the names exported here. Heavy imports happen
inside the functions: importing the package must not import the compiler.

One module per concern, in pipeline order:

- ``capture``: Dynamo's fullgraph capture and its shape environment;
- ``joint``: AOTAutograd's joint export, partitioning and Inductor's compile;
  ``graph_copy``: the copies of its graphs and joint each compile works on;
- ``guard_manager``: Dynamo's guards of a capture (the save-time filter's
  entries, the guard manager and its portable state);
- ``guard_vocab``: Dynamo's guard kinds sorted into the package's categories;
- ``functions``: PyTorch's ``AOTCompiledFunction`` (assembly, serialization,
  the accessors the runtime reads);
- ``codecache``: a C++ kernel's shared object from Inductor's code cache, and the
  shipped kernels loaded on PyTorch's full path (Inductor's code cache patched
  to load them instead of compiling);
- ``local_collectives``: collectives answered on one rank (a graph run on the
  saving rank alone);
- ``distributed``: DTensor meshes and ``compile_on_one_rank``;
- ``hooks``: the module hook dicts a call checks;
- ``contract``: every private PyTorch name this package and ``lean/`` use, in
  one list (its entry type ``contract_entry``, the compilers' entries
  ``contract_compilers``), checked on the installed torch by
  ``tests/test_torch_contract.py``.
"""

from .capture import (
    BEFORE_2_13,
    FROM_2_15,
    TRACES_DEEPCOPY,
    UNSERIALIZABLE_GUARD_KINDS,
    Capture,
    capture_error_fix,
    fullgraph_capture,
    is_capture_error,
    mark_dynamic,
    mark_static_address,
    shape_env_guard_exprs,
    shape_env_symbol_all_sources,
    shape_env_symbol_sources,
    shape_env_var_ranges,
    wants_size_oblivious,
)
from .codecache import (
    shipped_cpp_kernels,
    shipped_kernels_enabled,
)
from .functions import (
    begin_cudagraph_step,
    compiled_function_bytecode,
    compiled_function_closure_locals,
    compiled_function_device_type,
    compiled_function_globals,
    compiled_function_import_sources,
    compiled_function_parts,
    compiled_function_signature,
    compiled_graph_callable,
    concrete_zeros_like,
    deserialize_compiled_function,
    external_global_refs,
    global_state_snapshot,
    global_state_unchanged,
    guard_failure_reason,
    import_global_refs,
    linear_in_sizes,
    make_compiled_function,
    serialize_compiled_function,
    size_hint,
    stubbed_compiled_graph,
    unresolved_globals,
    wrap_compiled_graph,
)
from .graph_copy import without_duplicates
from .guard_manager import build_guard_manager
from .guard_vocab import CapturedGuard, SaveCandidate, captured_guards, save_candidate
from .hooks import hook_check, registered_global_hooks, registered_hooks
from .joint import (
    compile_joint,
    compiled_function_uses_cudagraphs,
    computed_once,
    default_decompositions,
    export_joint,
    inductor_options,
    joint_graph_module,
    joint_needs_autograd,
    joint_placeholder_count,
    kernels_read_thread_count,
)

__all__ = [
    "BEFORE_2_13",
    "FROM_2_15",
    "TRACES_DEEPCOPY",
    "UNSERIALIZABLE_GUARD_KINDS",
    "Capture",
    "CapturedGuard",
    "SaveCandidate",
    "begin_cudagraph_step",
    "build_guard_manager",
    "capture_error_fix",
    "captured_guards",
    "compile_joint",
    "compiled_function_bytecode",
    "compiled_function_closure_locals",
    "compiled_function_device_type",
    "compiled_function_globals",
    "compiled_function_import_sources",
    "compiled_function_parts",
    "compiled_function_signature",
    "compiled_function_uses_cudagraphs",
    "compiled_graph_callable",
    "computed_once",
    "concrete_zeros_like",
    "default_decompositions",
    "deserialize_compiled_function",
    "export_joint",
    "external_global_refs",
    "fullgraph_capture",
    "global_state_snapshot",
    "global_state_unchanged",
    "guard_failure_reason",
    "hook_check",
    "import_global_refs",
    "inductor_options",
    "is_capture_error",
    "joint_graph_module",
    "joint_needs_autograd",
    "joint_placeholder_count",
    "kernels_read_thread_count",
    "linear_in_sizes",
    "make_compiled_function",
    "mark_dynamic",
    "mark_static_address",
    "registered_global_hooks",
    "registered_hooks",
    "save_candidate",
    "serialize_compiled_function",
    "shape_env_guard_exprs",
    "shape_env_symbol_all_sources",
    "shape_env_symbol_sources",
    "shape_env_var_ranges",
    "shipped_cpp_kernels",
    "shipped_kernels_enabled",
    "size_hint",
    "stubbed_compiled_graph",
    "unresolved_globals",
    "wants_size_oblivious",
    "without_duplicates",
    "wrap_compiled_graph",
]
