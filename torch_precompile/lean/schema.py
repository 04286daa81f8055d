"""The lean format's schema: each record the ``lean`` section stores, one frozen dataclass.

A record's ``write()`` gives the plain form the file stores (dicts, lists, bytes:
what ``pickle`` holds), and its ``read()`` takes it back, side by side; the writer
(``lean_writer/``) builds the records, the reader (this folder) reads them, and no
stored key is spelled anywhere else. ``read`` accepts what earlier versions of the
package wrote: a key absent from an older file takes its default.

- :class:`LeanSection`: the section (Inductor's wrapper, Dynamo's bytecode, its
  globals, the signature, the guard state), with :class:`BackwardSection`
  (training), :class:`CompiledPython` (the code compiled at save), the runtime specs
  (:class:`InferenceSpec`, :class:`AutogradSpec`, :class:`SubclassSpec`,
  :class:`CUDAGraphSpec`) and each Triton kernel's :class:`TritonLaunch`;
- the guard tree (``lean_guards``) and what it stores: :mod:`.guard_schema`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from .pickling import dumps

if TYPE_CHECKING:
    from .guard_schema import GuardTree

LEAN_SECTION_VERSION = 1
AUTOGRAD_SPEC_VERSION = 1
RUNTIME_SPEC_VERSION = 1
SUBCLASS_SPEC_VERSION = 2  # 2: training (user_flat_outputs, grad_inputs)
SUBCLASS_SPEC_VERSIONS_READ = (1, 2)
TRITON_SPEC_VERSION = 1

_VERSION = "version"
# The section's fields that only Dynamo's guard manager reads (a load's imports
# from them are the fallback's).
FALLBACK_FIELDS = ("guards_state",)  # LeanSection.guards_state


def versioned(version: int, fields: dict[str, Any]) -> dict[str, Any]:
    """A record's stored form: its version first, then its fields."""
    return {_VERSION: version, **fields}


def unversioned(stored: dict[str, Any], versions: tuple[int, ...], what: str) -> dict[str, Any]:
    """The fields of a record stored by :func:`versioned` with one of ``versions``;
    ValueError naming ``what`` for any other."""
    fields = dict(stored)
    if fields.pop(_VERSION, None) not in versions:
        raise ValueError(f"the lean {what} was written by another version")
    return fields


# ------------------------------------------------------------------ runtime specs


@dataclasses.dataclass(frozen=True)
class InferenceSpec:
    """What running an inference graph needs beyond calling it.

    ``aliases``: per user output, None (its own memory), or ``(input index, is the
    input itself, requires_grad)`` for an output that is (a view of) that input.
    ``dynamic_dims``: per user output, its dynamic dimensions, which the runtime
    marks on the tensor for a next compiled graph; () if none.
    """

    mutated_seen_by_autograd: tuple[int, ...] = ()
    aliases: tuple[tuple[int, bool, bool] | None, ...] = ()
    dynamic_dims: tuple[tuple[int, ...] | None, ...] = ()

    def write(self) -> dict[str, Any]:
        return versioned(RUNTIME_SPEC_VERSION, dataclasses.asdict(self))

    @classmethod
    def read(cls, stored: dict[str, Any] | None) -> InferenceSpec | None:
        """Absent (None): a training artifact, or a file that had none (the default)."""
        if stored is None:
            return None
        return cls(**unversioned(stored, (RUNTIME_SPEC_VERSION,), "runtime spec"))


@dataclasses.dataclass(frozen=True)
class AutogradSpec:
    """What running the compiled forward and backward under autograd needs.

    Indices count the compiled forward's outputs: the user's outputs come first
    (``num_forward_returns``), then what the backward reads.
    """

    num_forward_returns: int
    saved_vc_check: slice  # saved with ``save_for_backward`` (version-checked)
    saved_no_vc_check: slice  # kept on ctx as is (AOTAutograd's no-vc-check tensors)
    saved_symints: slice
    unsafe_view_outputs: tuple[int, ...]
    non_differentiable: tuple[int, ...]
    tangent_outputs: tuple[int, ...]  # outputs whose gradients the backward takes, in order
    tangent_layouts: tuple[Any, ...]  # per tangent: (size, stride) or a torch.memory_format
    donated_buffers: bool  # the backward reuses saved buffers: no retain_graph
    nondeterministic: bool  # compiled with deterministic algorithms off
    # Inputs the forward writes (in the graph) whose writes autograd must see
    # (absent: a file written before input mutations ran lean).
    mutated_seen_by_autograd: tuple[int, ...] = ()
    # Opaque objects (a DTensor's DeviceMesh) the backward reads (absent: none).
    saved_opaque: slice = dataclasses.field(default_factory=lambda: slice(0, 0))


@dataclasses.dataclass(frozen=True)
class SubclassSpec:
    """How the compiled graph's plain inputs and outputs map to the model's.

    ``inputs``: per graph input of Dynamo's graph, None (passed as it is) or the
    attribute names its subclass flattens into, in order. ``outputs``: per user
    output, ``[index]`` (a plain output) or ``[start, module, qualname, attrs, meta
    (pickled), outer_size, outer_stride]``: a subclass rebuilt from the plain outputs
    from ``start`` on. ``mesh_constants``: the wrapper's constants that are the
    DeviceMesh (forward and backward). Training: ``user_flat_outputs`` of the
    forward's plain outputs are the user's (the rest are activations for the
    backward), and ``grad_inputs`` rebuilds the backward's plain gradients, one per
    graph input, as ``outputs`` does.
    """

    inputs: tuple[tuple[str, ...] | None, ...] = ()
    outputs: tuple[tuple[Any, ...], ...] = ()
    mesh_constants: tuple[str, ...] = ()
    user_flat_outputs: int | None = None
    grad_inputs: tuple[tuple[Any, ...], ...] = ()

    def write(self) -> dict[str, Any]:
        return versioned(SUBCLASS_SPEC_VERSION, dataclasses.asdict(self))

    @classmethod
    def read(cls, stored: dict[str, Any] | None) -> SubclassSpec | None:
        """Absent (None): no tensor subclass inputs or outputs."""
        if stored is None:
            return None
        return cls(**unversioned(stored, SUBCLASS_SPEC_VERSIONS_READ, "subclass spec"))


@dataclasses.dataclass(frozen=True)
class CUDAGraphSpec:
    """What recording needs, read off Inductor's compiled graph at save.

    ``static_inputs``: the graph's inputs read in place (parameters, buffers).
    ``partitions``: with Inductor's graph partitions (ops that cannot be recorded
    run between them), each partition's static inputs; each partition is recorded
    on its own, as Inductor does.
    """

    static_inputs: tuple[int, ...]
    device_index: int
    partitions: tuple[tuple[int, ...], ...] | None = None


@dataclasses.dataclass(frozen=True)
class TritonLaunch:
    """One autotuned Triton kernel, launched by PyTorch's static CUDA launcher:
    its cubin (a key of the kernels), the kernel's name, Inductor's launcher code
    (marshalled) and its defaults, and what the runner passes the driver."""

    cubin: str
    name: str
    launcher: bytes
    defaults: tuple[Any, ...] | None
    num_warps: int
    shared: int
    arg_tys: str
    scratch: int  # unused scratch pointers newer Triton takes (None for each)
    device: int
    profile_name: str

    def write(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # no version: read as TRITON_SPEC_VERSION

    @classmethod
    def read(cls, stored: dict[str, Any], key: str) -> TritonLaunch:
        """``key``: the kernel's own key, the cubin's name in a file before cubins
        were named apart (one binary per source)."""
        fields = dict(stored)
        if fields.pop(_VERSION, TRITON_SPEC_VERSION) != TRITON_SPEC_VERSION:
            raise ValueError("the Triton kernel spec was written by another version")
        fields.setdefault("cubin", key)
        return cls(**fields)


# ------------------------------------------------------------------ the section


@dataclasses.dataclass(frozen=True)
class CompiledPython:
    """The code a load would compile, compiled at save (each :mod:`.pycode`'s record,
    None where none was): the forward's wrapper, the backward's, the guard check, and
    the guard check's emission (``Emitted.write``, pickled)."""

    wrapper: dict[str, Any] | None = None
    backward: dict[str, Any] | None = None
    guards: dict[str, Any] | None = None
    prepared: bytes | None = None

    def write(self) -> dict[str, Any]:
        out: dict[str, Any] = {"wrapper": self.wrapper}
        if self.backward is not None:
            out["backward"] = self.backward
        if self.guards is not None:
            prepared = {} if self.prepared is None else {"prepared": self.prepared}
            out["guards"] = {**self.guards, **prepared}
        return out

    @classmethod
    def read(cls, stored: dict[str, Any] | None) -> CompiledPython:
        """Absent (None): a file before code was compiled at save."""
        stored = stored or {}
        guards = stored.get("guards")
        return cls(
            stored.get("wrapper"),
            stored.get("backward"),
            guards,
            guards.get("prepared") if isinstance(guards, dict) else None,
        )


@dataclasses.dataclass(frozen=True)
class BackwardSection:
    """Training: the backward's wrapper and how autograd runs the pair."""

    wrapper: str
    inputs_to_check: tuple[int, ...]
    autograd: AutogradSpec

    def write(self) -> dict[str, Any]:
        return versioned(
            AUTOGRAD_SPEC_VERSION,
            {
                "wrapper": self.wrapper,
                "inputs_to_check": list(self.inputs_to_check),
                "autograd": dataclasses.asdict(self.autograd),
            },
        )

    @classmethod
    def read(cls, stored: dict[str, Any] | None) -> BackwardSection | None:
        """Absent (None): an inference artifact."""
        if stored is None:
            return None
        fields = unversioned(stored, (AUTOGRAD_SPEC_VERSION,), "backward")
        return cls(
            fields["wrapper"], tuple(fields["inputs_to_check"]), AutogradSpec(**fields["autograd"])
        )


@dataclasses.dataclass(frozen=True)
class LeanSection:
    """What the lean runtime needs to run one compiled function without the compiler.

    The ``bytes`` fields are pickles the writer made (:mod:`.pickling`), read when
    used. ``lean_guards`` is the guard tree (a :class:`GuardTree` as written; its
    pickle as read, unpickled only when the load emits the check; a dict in a file
    before it was pickled apart). Optional parts are None when absent.
    """

    wrapper: str  # Inductor's generated Python (the forward's)
    extern_kernels: list[str]
    inputs_to_check: list[int]
    mutated_inputs: list[int]
    bytecode: bytes  # Dynamo's transformed bytecode
    import_sources: dict[str, str]
    global_homes: dict[str, Any]
    used_globals: bytes
    used_global_names: list[str]
    external_refs: list[str]
    argdefs: Any
    closure: bytes | None
    kwdefaults: Any
    backend_id: str
    signature: bytes
    original_code: bytes
    guards_state: Any  # Dynamo's, for its guard manager (FALLBACK_FIELDS)
    lean_guards: GuardTree | bytes | dict[str, Any] | None
    hook_guards: bool
    device_type: str
    triton: dict[str, TritonLaunch]  # kernel key -> launch (cubin in the kernels)
    cudagraphs: CUDAGraphSpec | None  # mode="reduce-overhead": how to record
    pycode: CompiledPython
    inference: InferenceSpec | None = None
    subclasses: SubclassSpec | None = None
    backward: BackwardSection | None = None
    torch_version: str = torch.__version__

    def write(self) -> dict[str, Any]:
        """The stored form (a dict; the file holds its pickle)."""
        spec: dict[str, Any] = {
            _VERSION: LEAN_SECTION_VERSION,
            "torch": self.torch_version,
            "wrapper": self.wrapper,
            "extern_kernels": self.extern_kernels,
            "inputs_to_check": self.inputs_to_check,
            "mutated_inputs": self.mutated_inputs,
            "bytecode": self.bytecode,
            "import_sources": self.import_sources,
            "global_homes": self.global_homes,
            "used_globals": self.used_globals,
            "used_global_names": self.used_global_names,
            "external_refs": self.external_refs,
            "argdefs": self.argdefs,
            "closure": self.closure,
            "kwdefaults": self.kwdefaults,
            "backend_id": self.backend_id,
            "signature": self.signature,
            "original_code": self.original_code,
            "guards_state": self.guards_state,
            "lean_guards": _pickled_apart(self.lean_guards),
            "hook_guards": self.hook_guards,
            "device_type": self.device_type,
            "triton": {key: launch.write() for key, launch in self.triton.items()},
            "cudagraphs": None if self.cudagraphs is None else dataclasses.asdict(self.cudagraphs),
        }
        if self.inference is not None:
            spec["inference"] = self.inference.write()
        if self.subclasses is not None:
            spec["subclasses"] = self.subclasses.write()
        if self.backward is not None:
            spec["backward"] = self.backward.write()
        spec["pycode"] = self.pycode.write()
        return spec

    @classmethod
    def read(cls, stored: dict[str, Any]) -> LeanSection:
        """The section of ``stored``; ValueError if another version of the package or
        of torch wrote it. A key an older file lacks takes what that file meant."""
        if stored.get(_VERSION) != LEAN_SECTION_VERSION or stored.get("torch") != torch.__version__:
            raise ValueError("the lean section was written by another version")
        cudagraphs = stored.get("cudagraphs")
        return cls(
            wrapper=stored["wrapper"],
            extern_kernels=stored["extern_kernels"],
            inputs_to_check=stored["inputs_to_check"],
            mutated_inputs=stored.get("mutated_inputs", ()),
            bytecode=stored["bytecode"],
            import_sources=stored["import_sources"],
            global_homes=stored.get("global_homes", {}),
            used_globals=stored["used_globals"],
            used_global_names=stored.get("used_global_names", ()),
            external_refs=stored.get("external_refs", ()),
            argdefs=stored["argdefs"],
            closure=stored.get("closure"),
            kwdefaults=stored["kwdefaults"],
            backend_id=stored["backend_id"],
            signature=stored["signature"],
            original_code=stored["original_code"],
            guards_state=stored["guards_state"],
            lean_guards=stored.get("lean_guards", stored.get("light_guards")),  # format 2
            hook_guards=bool(stored.get("hook_guards")),  # absent: built without them
            device_type=stored.get("device_type", "cpu"),
            triton={k: TritonLaunch.read(v, k) for k, v in (stored.get("triton") or {}).items()},
            cudagraphs=CUDAGraphSpec(**cudagraphs) if cudagraphs else None,
            pycode=CompiledPython.read(stored.get("pycode")),
            inference=InferenceSpec.read(stored.get("inference")),
            subclasses=SubclassSpec.read(stored.get("subclasses")),
            backward=BackwardSection.read(stored.get("backward")),
            torch_version=stored["torch"],
        )


def _pickled_apart(guards: GuardTree | bytes | dict[str, Any] | None) -> bytes | None:
    """The guard tree's pickle: a load whose saved check fits never unpickles it."""
    if guards is None or isinstance(guards, bytes):
        return guards
    return dumps(guards if isinstance(guards, dict) else guards.write())
