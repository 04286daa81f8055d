"""The attention backends a generator's steps are built with on a GPU
(runtime/attention_backends.py): the process's own, cuDNN's left out.

Which kernel a traced ``scaled_dot_product_attention`` becomes is read from
torch's backend flags at trace time, so the flags inside the context are what a
build gets; tests/test_cuda_runtime.py checks the built prefill's kernels on a
GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_precompile.runtime.attention_backends import without_cudnn


def _flags() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    before = _flags()
    yield
    assert _flags() == before


def test_on_cuda_cudnn_is_left_out_and_the_rest_kept_then_restored() -> None:
    before = _flags()
    assert before["cudnn"]  # torch's default
    with without_cudnn(torch.device("cuda", 0)):
        assert _flags() == {**before, "cudnn": False}
    assert _flags() == before


def test_the_callers_own_choice_stands() -> None:
    chosen = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(chosen), without_cudnn("cuda"):  # flash and math stay off, as set
        assert _flags() == {"cudnn": False, "flash": False, "efficient": True, "math": False}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), without_cudnn("cuda"):  # alone: kept
        assert _flags() == {"cudnn": True, "flash": False, "efficient": False, "math": False}


def test_off_cuda_nothing_changes() -> None:
    before = _flags()
    for device in ("cpu", torch.device("meta")):
        with without_cudnn(device):
            assert _flags() == before


def _prefill(args: tuple, kwargs: dict) -> bool:
    """Whether a captured step is a prefill: a forward call whose cache is empty, or a
    generator step of more than one token a row (its first argument)."""
    if "input_ids" in kwargs:
        cache = kwargs.get("past_key_values")
        return cache is None or cache.get_seq_length() == 0
    return args[0].shape[1] > 1


def test_builds_trace_each_prefill_inside_it_and_decode_steps_as_torch_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compile_generator and compile_for_generation capture every prefill inside
    ``without_cudnn`` for the model's device (through ``tracing_attention``; a CPU model
    here, given CUDA's flags), and every decode step outside it."""
    transformers = pytest.importorskip("transformers")
    from torch_precompile import _compat
    from torch_precompile.generation import compile_for_generation, compile_generator
    from torch_precompile.runtime import attention_backends

    devices: list[str] = []
    captured: list[tuple[bool, bool]] = []  # (a prefill, cuDNN enabled)

    def as_on_cuda(device: torch.device | str) -> object:
        devices.append(torch.device(device).type)
        return without_cudnn("cuda")

    capture = _compat.fullgraph_capture

    def recorded(model: object, args: tuple, kwargs: dict, *rest: object) -> object:
        captured.append((_prefill(args, kwargs), torch.backends.cuda.cudnn_sdp_enabled()))
        return capture(model, args, kwargs, *rest)

    monkeypatch.setattr(attention_backends, "without_cudnn", as_on_cuda)
    monkeypatch.setattr(_compat, "fullgraph_capture", recorded)
    from test_generator import SMALL

    config = transformers.LlamaConfig(num_key_value_heads=2, **SMALL)
    model = transformers.LlamaForCausalLM(config).eval()
    for build in (
        lambda: compile_generator(model, max_batch=1, max_length=16),
        # batch-1 programs only: a prefill and a decode step are what is checked
        lambda: compile_for_generation(
            model, torch.ones((1, 4), dtype=torch.long), single_batch=True
        ),
    ):
        devices.clear()
        captured.clear()
        build()
        assert devices and set(devices) == {"cpu"}
        prefills = [on for prefill, on in captured if prefill]
        decodes = [on for prefill, on in captured if not prefill]
        assert prefills and not any(prefills), captured
        assert decodes and all(decodes), captured
