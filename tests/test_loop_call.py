"""LoopCall (runtime/loop.py): a loop's guards checked once per input layout.

A recording runtime stands for the artifact's: ``checked_call`` is the full
path (every guard), ``call_known`` the path without the guards. Each case
says which of the two a call takes. The generator's own loop, on real files,
is in ``test_generator.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_precompile.runtime.loop import LoopCall


class _Recorder:
    def __init__(self) -> None:
        self.paths: list[str] = []
        self.args: list[tuple[Any, ...]] = []

    def checked_call(self, args: tuple[Any, ...]) -> tuple[Any, Any]:
        self.paths.append("checked")
        self.args.append(args)
        return self, "result"

    def call_known(self, args: tuple[Any, ...]) -> Any:
        self.paths.append("known")
        self.args.append(args)
        return "result"


def _loop() -> tuple[_Recorder, LoopCall, torch.Tensor]:
    runtime = _Recorder()
    cache = torch.zeros(2, 4, 8)
    return runtime, LoopCall(runtime, [cache]), cache


def test_the_first_call_of_a_layout_is_checked_then_the_same_layout_is_known() -> None:
    runtime, loop, cache = _loop()
    for _ in range(3):
        assert loop(torch.zeros(2, 1, dtype=torch.long), torch.tensor(0)) == "result"
    assert runtime.paths == ["checked", "known", "known"]
    assert all(args[-1] is cache for args in runtime.args)  # the fixed inputs, last


def test_a_new_shape_dtype_device_stride_or_grad_flag_is_checked_again() -> None:
    runtime, loop, _ = _loop()
    x = torch.zeros(2, 3)
    loop(x)
    for other in (
        torch.zeros(3, 3),  # shape
        torch.zeros(2, 3, dtype=torch.float64),  # dtype
        torch.zeros(3, 2).t(),  # stride
        torch.zeros(2, 3, requires_grad=True),  # requires_grad
        torch.nn.Parameter(torch.zeros(2, 3)),  # type
    ):
        before = len(runtime.paths)
        loop(other)
        loop(other)
        assert runtime.paths[before:] == ["checked", "known"], other
    loop(x)
    assert runtime.paths[-1] == "known"  # each layout keeps its verdict


def test_a_change_of_torchs_global_state_is_checked_again() -> None:
    runtime, loop, _ = _loop()
    x = torch.zeros(2, 3)
    loop(x)
    loop(x)
    dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        loop(x)
    finally:
        torch.set_default_dtype(dtype)
    loop(x)  # the state checked last is float64's: float32 is checked again
    with torch.no_grad():
        loop(x)
    with torch.inference_mode():
        loop(x)
    assert runtime.paths == ["known" if i == 1 else "checked" for i in range(6)]


def test_inputs_sharing_memory_make_another_layout() -> None:
    runtime, loop, _ = _loop()
    a, b = torch.zeros(4), torch.zeros(4)
    loop(a, b)
    base = torch.zeros(8)
    loop(base[:4], base[4:])  # same layouts, one storage
    loop(base[:4], base[4:])
    loop(a, b)
    assert runtime.paths == ["checked", "checked", "known", "known"]


def test_python_values_are_keyed_by_value_and_unhashable_ones_always_checked() -> None:
    runtime, loop, _ = _loop()
    loop(3)
    loop(3)
    loop(4)
    loop([1])
    loop([1])
    assert runtime.paths == ["checked", "known", "checked", "checked", "checked"]


class _NoStorage(torch.Tensor):
    """A tensor subclass whose storage cannot be read (as a wrapper subclass's)."""

    def untyped_storage(self) -> Any:
        raise RuntimeError("no storage")


def test_a_tensor_whose_storage_cannot_be_read_is_always_checked() -> None:
    runtime, loop, _ = _loop()
    x = torch.zeros(2).as_subclass(_NoStorage)
    loop(x)
    loop(x)
    assert runtime.paths == ["checked", "checked"]
