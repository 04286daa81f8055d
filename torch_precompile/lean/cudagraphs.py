"""``mode="reduce-overhead"`` after a lean load: the compiled graph recorded into
CUDA graphs with ``torch.cuda.CUDAGraph``, without Inductor's CUDA graph trees.

Inductor's trees (``torch/_inductor/cudagraph_trees.py``) import its compiler
(``compile_fx``) and Dynamo, seconds of start-up that a lean load exists to
avoid. For one inference graph the trees do little that matters here, and this
module does the same, per input layout:

- the first call runs the graph as compiled (warm-up: lazy CUDA and cuBLAS set-up);
- the second records it into a CUDA graph, in a private memory pool, reading
  the static inputs (parameters, buffers) where they are and the other inputs
  from copies it owns;
- later calls copy the inputs in and replay.

A call inside :func:`not_recorded` runs as compiled, neither recorded nor
replayed: a generator's prefill, whose every prompt length is another layout.
Each recording keeps its own memory pool, so one a length grows without bound
(measured on one H200, a four-layer Llama-3.2-3B-shaped prefill: 2.0 GB more
reserved after 33 lengths from 16 to 1,040 tokens), for a replay that saves
little on a step that long.

As with the trees, a call's outputs live in the graph's memory until the
next replay of that graph, which overwrites them; a tensor of the earlier
outputs then raises on access with the trees' message instead of reading the
new values. Clone an output to keep it. A static input whose memory moved
(weights reassigned) makes a new recording, as with the trees. Calls are
serialised: a recording has one set of input buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from .schema import CUDAGraphSpec
from .wrapper import clone_preserve_strides

log = logging.getLogger("torch_precompile")

OVERWRITTEN = (
    "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent "
    "run (torch_precompile lean reduce-overhead). To prevent overwriting, clone the tensor "
    "before calling the model again."
)

# Process-wide counts (for benchmarks and tests): CUDA graphs recorded, replays.
STATS = {"recorded": 0, "replayed": 0}

CallList = Callable[[list[Any], "list[Any] | None"], Any]

_NOT_RECORDED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torch_precompile_not_recorded", default=False
)


@contextlib.contextmanager
def not_recorded() -> Iterator[None]:
    """Calls in this block (this thread or task) run as compiled: no CUDA graph is
    recorded or replayed for them (see the module docstring)."""
    token = _NOT_RECORDED.set(True)
    try:
        yield
    finally:
        _NOT_RECORDED.reset(token)


def install(
    call: CallList, apply_to_partitions: Callable[[list[Any]], None] | None, spec: CUDAGraphSpec
) -> CallList:
    """Record the compiled graph's CUDA graphs: the whole graph, or each partition
    (``apply_to_partitions``: the wrapper's ``recursively_apply_fns``)."""
    if spec.partitions is None:
        return CUDAGraphRunner(call, spec.static_inputs, spec.device_index).call_list
    if apply_to_partitions is None:
        raise ValueError("the wrapper has no graph partitions to record")

    def recorder(static: tuple[int, ...]) -> Callable[[Any], Any]:
        def wrap(partition: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
            runner = CUDAGraphRunner(
                lambda inputs, received: partition(inputs), static, spec.device_index
            )
            return runner.call_list

        return wrap

    apply_to_partitions([recorder(static) for static in spec.partitions])
    return call


class _Recording:
    """One CUDA graph of the compiled graph, for one input layout."""

    def __init__(self, call: CallList, inputs: list[Any], static: frozenset[int]) -> None:
        self.copied = [
            i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and i not in static
        ]
        self.inputs = list(inputs)
        for i in self.copied:
            self.inputs[i] = clone_preserve_strides(inputs[i])
        self.graph = torch.cuda.CUDAGraph()
        self.received: list[Any] = []
        with torch.cuda.graph(self.graph):
            self.outputs = call(list(self.inputs), self.received)
        STATS["recorded"] += 1
        self.handed_out: list[torch.UntypedStorage] = []

    def replay(self, inputs: list[Any], received: list[Any] | None) -> Any:
        for i in self.copied:
            self.inputs[i].copy_(inputs[i])
        for storage in self.handed_out:  # the previous call's outputs: overwritten now
            # As Inductor's trees mark them (a CUDA build of torch has it).
            torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, OVERWRITTEN)
        self.handed_out = []
        self.graph.replay()
        STATS["replayed"] += 1
        if received is not None:
            received.extend(self.received)
        return self._hand_out()

    def _hand_out(self) -> list[Any]:
        """The outputs as new tensors over the graph's memory (one storage per
        storage of the recorded outputs), which the next replay can invalidate
        without touching the recording's own tensors."""
        storages: dict[int, torch.UntypedStorage] = {}
        out: list[Any] = []
        for t in self.outputs:
            if not isinstance(t, torch.Tensor):
                out.append(t)
                continue
            recorded = t.untyped_storage()
            storage = storages.get(recorded.data_ptr())
            if storage is None:
                storage = torch._C._construct_storage_from_data_pointer(
                    recorded.data_ptr(), t.device, recorded.nbytes()
                )
                storages[recorded.data_ptr()] = storage
                self.handed_out.append(storage)
            view = torch.empty((0,), dtype=t.dtype, device=t.device)
            view.set_(storage, t.storage_offset(), t.size(), t.stride())
            out.append(view)
        return out


class CUDAGraphRunner:
    """The compiled graph's boxed call (``call_list(inputs, received)``), replayed
    from CUDA graphs recorded per input layout (see the module docstring)."""

    def __init__(self, call: CallList, static_inputs: tuple[int, ...], device_index: int) -> None:
        self._call = call
        self._static = frozenset(static_inputs)
        self._device = torch.device("cuda", device_index)
        self._recordings: dict[Hashable, _Recording | None] = {}  # None: warmed up
        self._lock = threading.Lock()
        self._disabled: str | None = None  # why recording failed, if it did
        self._kinds: tuple[tuple[int, ...], ...] | None = None
        self._statics: Callable[[list[Any]], tuple[Any, ...]] | None = None

    def _key(self, inputs: list[Any]) -> Hashable:
        """The recording these inputs replay: the static inputs' addresses (moved
        weights record again), the others' layouts, the scalars' values."""
        if self._kinds is None:  # which input is which never changes (Dynamo guards it)
            static = sorted(i for i in self._static if i < len(inputs))
            self._kinds = (
                tuple(static),
                tuple(
                    i
                    for i, x in enumerate(inputs)
                    if isinstance(x, torch.Tensor) and i not in self._static
                ),
                tuple(i for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)),
            )
            # Every call reads the static inputs' addresses (hundreds of weights):
            # fetched in C rather than a Python loop.
            self._statics = operator.itemgetter(*static, 0, 0) if static else None
        static, tensors, scalars = self._kinds
        picked = self._statics(inputs)[: len(static)] if self._statics is not None else ()
        return (
            tuple(map(torch.Tensor.data_ptr, picked)),
            tuple((inputs[i].shape, inputs[i].stride(), inputs[i].dtype) for i in tensors),
            tuple(inputs[i] for i in scalars),
        )

    def call_list(self, inputs: list[Any], received: list[Any] | None = None) -> Any:
        if self._disabled is not None or _NOT_RECORDED.get():
            return self._call(inputs, received)
        with self._lock:
            key = self._key(inputs)
            if key not in self._recordings:
                self._recordings[key] = None
                return self._call(inputs, received)  # warm-up run, as the trees do
            recording = self._recordings[key]
            if recording is None:
                try:
                    with torch.cuda.device(self._device):
                        recording = _Recording(self._call, inputs, self._static)
                except Exception as exc:  # a graph that cannot be captured runs as compiled
                    self._disabled = f"{type(exc).__name__}: {exc}"
                    log.warning("CUDA graph recording failed; running without: %s", exc)
                    return self._call(inputs, received)
                self._recordings[key] = recording
            return recording.replay(inputs, received)
